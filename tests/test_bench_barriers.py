"""mosaic_barriers on the CPU: the barrier count by loop depth, and its table of every Mosaic
kernel of the default GPU pipeline and of OSGM's Mosaic phase 1."""

import sys

from benchmarks import mosaic_barriers


def test_barriers_by_loop_depth():
    text = """
    func.func @k() {
      llvm.inline_asm "bar.sync $0, 128;"
      %0 = scf.for %i = %a to %b step %c iter_args(%x = %y) -> (f32) {
        %1:2 = scf.while (%u = %v) : (f32) -> (f32) {
          llvm.inline_asm "bar.sync $0, 128;" {attr = 1}
          scf.condition(%t) %u : f32
        } do {
        ^bb0(%w: f32):
          llvm.inline_asm "bar.sync $0, 128;"
          scf.yield %w : f32
        }
        scf.if %p {
          llvm.inline_asm "bar.sync $0, 128;"
        }
        scf.yield %1 : f32
      }
      llvm.inline_asm "bar.sync $0, 128;"
    }
    """
    assert mosaic_barriers.barriers(text) == {0: 2, 1: 1, 2: 2}


def test_table_names_every_kernel(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["mosaic_barriers.py", "--core", "deltanet"])
    mosaic_barriers.main()
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"wy_inverse_mosaic", "state_fwd_wy_mosaic", "state_bwd_wy_mosaic",
                         "chunk_grads_mosaic", "osgm_fwd_mosaic", "osgm_bwd_mosaic"}
    assert "3:" not in rows["osgm_fwd_mosaic"] and "2:" in rows["osgm_fwd_mosaic"]
