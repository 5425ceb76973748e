"""What the per-coordinate Mosaic GPU kernels share (``osgm_mosaic``, ``atk_mosaic``): one CTA a
(batch row, head), one warpgroup whose 128 threads each hold one coordinate of the carried state,
tiles of ``TILE`` tokens arriving by TMA (double-buffered) and leaving by TMA (``walk``); or two
warpgroups, the carry's chain on one and the per-tile work around it on the other
(``walk_pair``).

Per-token passes run by rows, thread j at its own coordinate of a [TILE, 128] shared-memory
tile, which meets no bank conflict and needs no barrier; the loads of ``GROUP`` tokens go out
before their steps (``tokens``). A tile that is also read whole in the WGMMA layout (for row
sums over the coordinates) has its rows padded to ``KP`` floats. Kernels run without Pallas's
automatic barriers: every hand-off between threads goes through ``plgpu.commit_smem``. Per-token
scalars travel as float32 rows [B, H, n, Tp]; packed documents add three rows (each token's
document id, first and last flags) and restart the carry from a document's state.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.compute_on import compute_on
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.partition import sharded_call
from pallas_kernels.state_mosaic import kernel, read
from precond_linattn.layout import row_major

F32 = jnp.float32
K_THREADS = 128  # the head dim the kernels take: one coordinate a thread of a warpgroup
TILE = 64  # tokens a tile (the rows of the WGMMA layout); T is padded to a multiple of it
VEC = plgpu.Layout.WG_STRIDED((K_THREADS,), vec_size=1)
KP = K_THREADS + 8  # the row stride (floats) of the tiles read both by rows and whole:
# row t starts 8 banks after row t - 1, so the WGMMA layout's reads of 8 rows at once meet no
# bank conflict (at stride 128 they are 8-way)
GROUP = 8  # tokens whose shared-memory loads are issued together, ahead of their steps


def rows_layout(rows, docs, Tp, ones):
    """Per-token rows [B, T, H] each (then, if ``docs``, its three rows: each token's document
    id and first / last flags [B, T]) as [B, H, n, Tp] float32, padded with zeros (no document
    flags) but row ``ones`` with ones. The rows are materialised [B, T, H] first: left to
    XLA, a row with a reduction over K (n̄ = |k|² in w) fuses into the transposing stack, each
    thread then reducing a token's K values with 2 KB between neighbours (0.070 ms at
    8x2048x8x128 on the H200, RESULTS run 122; apart, run 123: the reduction 0.011 and the
    stack too short to list). Each row is pinned row-major (``row_major``) before the barrier."""
    rows = lax.optimization_barrier(tuple(row_major(x) for x in rows))
    B, T, H = rows[0].shape
    rows = list(rows) + ([] if docs is None else [jnp.broadcast_to(
        x.astype(F32)[..., None], (B, T, H)) for x in docs])
    x = jnp.pad(jnp.stack(rows, axis=1), [(0, 0), (0, 0), (0, Tp - T), (0, 0)])
    return jnp.transpose(x.at[:, ones, T:].set(1.0), (0, 3, 1, 2))


def padded_length(T):
    """T rounded up to whole tiles."""
    return -(-T // TILE) * TILE


def tile_padded(x, Tp):
    """x [B, T, H, K] zero-padded along T to Tp tokens."""
    return jnp.pad(x, [(0, 0), (0, Tp - x.shape[1]), (0, 0), (0, 0)])


def token_rows(rows, T):
    """The rows [B, H, n, Tp] a kernel returns, as n arrays [B, T, H] (row-major, ``row_major``)."""
    return tuple(row_major(jnp.moveaxis(rows[:, :, j, :T], 1, 2)) for j in range(rows.shape[2]))


def pair_fits(*seqs):
    """Whether two warpgroups fit with these sequence inputs: 16-bit ones (float32 ones leave
    no shared memory for a second tile of the buffers two warpgroups keep in flight)."""
    return all(x.dtype.itemsize <= 2 for x in seqs)


def check_warpgroups(warpgroups, *seqs):
    """ValueError unless ``warpgroups`` is 1, or 2 where ``pair_fits(*seqs)``."""
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups!r}")
    if warpgroups == 2 and not pair_fits(*seqs):
        raise ValueError(f"warpgroups=2 takes 16-bit inputs (no shared memory for two tiles in "
                         f"flight with float32 ones), got {[str(x.dtype) for x in seqs]}")


def call(kernel, args, in_axes, out_axes, *, packed, interpret, stream=None):
    """``kernel(*args)`` (its static arguments bound) through ``partition.sharded_call``: batch
    rows and heads stay sharded (heads only with packed documents); unpartitioned in interpret
    mode, whose I/O callbacks ``custom_partitioning`` cannot lower. ``stream``: the call on
    that XLA GPU stream (``on_stream``)."""
    return sharded_call(on_stream(lambda *xs: tuple(kernel(*xs)), stream), args, in_axes,
                        out_axes, shard_batch=not packed, direct=interpret)


def on_stream(fn, stream):
    """``fn`` as one call on the GPU's stream number ``stream`` (None: ``fn`` as it is).

    ``compute_on("gpu_stream:N")`` makes XLA run the call asynchronously beside the main
    stream, so that work not waiting on its results can fill the SMs its CTAs leave idle (the
    per-coordinate kernels run one latency-bound CTA a (row, head): 64 of the H200's 132 SMs
    at 8 x 8 heads). Values are the same either way; on a CPU the annotation is ignored.
    XLA has so far scheduled nothing beside such a call's kernel (RESULTS runs 210, 216: it
    gives each result of the call its own async get-tuple-element pair, and puts other work
    beside those; ``benchmarks/stream_overlap.py`` tries one tuple-valued call)."""
    if stream is None:
        return fn
    check_stream(stream, "stream")
    return compute_on(compute_type=f"gpu_stream:{stream}",
                      out_memory_spaces=jax.memory.Space.Device)(fn)


def check_stream(stream, name="Options.stream"):
    """ValueError naming ``name`` unless ``stream`` is None or an int >= 1."""
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)
                               or stream < 1):
        raise ValueError(f"{name} must be None or an int >= 1 (0 is XLA's main stream), "
                         f"got {stream!r}")


def check_shape(name, K, Tp):
    """ValueError naming the kernel ``name`` unless K = 128 and Tp is whole tiles."""
    if K != K_THREADS or Tp % TILE:
        raise ValueError(f"{name} takes K = {K_THREADS} and T a multiple of {TILE}, "
                         f"got K={K}, T={Tp}")


def walk(n_tiles, reverse, issue, in_bar, start_bar, state, start, end, run_tile,
         store_tile):
    """The tile loop of a CTA: ``n_tiles`` tiles in order (descending if ``reverse``),
    double-buffered (slot j % 2 for the j-th walked; ``issue(i, slot)`` sends tile i's copies
    to ``in_bar[slot]``, the next tile's right after this one's arrived), the carry (one
    coordinate a thread) from the GMEM ref ``start`` (by ``start_bar``) through ``state`` to
    ``end``; ``run_tile(i, slot, carry)`` returns the next carry after writing the tile's
    outputs into slot ``slot``, which ``store_tile(i, slot)`` sends (one commit group a tile:
    the slot is reused once the group of two tiles before has been read)."""
    at = (lambda j: n_tiles - 1 - j) if reverse else (lambda j: j)
    issue(at(0), 0)
    plgpu.copy_gmem_to_smem(start, state, start_bar)
    plgpu.barrier_wait(start_bar)

    def body(j, carry):
        i, slot = at(j), lax.rem(j, 2)
        with jax.named_scope("wait_in"):
            plgpu.barrier_wait(in_bar.at[slot])

        @pl.when(j + 1 < n_tiles)
        def _next():
            issue(at(j + 1), 1 - slot)

        with jax.named_scope("wait_out"):
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's last outputs were sent
            plgpu.commit_smem()  # (one thread waited: the others wait for it here)
        carry = run_tile(i, slot, carry)
        with jax.named_scope("store"):
            plgpu.commit_smem()
            store_tile(i, slot)
        return carry

    carry = lax.fori_loop(0, n_tiles, body, plgpu.load(state, layout=VEC))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if end is not None:
        state[...] = carry
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state, end)
    plgpu.wait_smem_to_gmem(0)


def walk_pair(n_tiles, reverse, issue, in_bar, ready, done, start_bar, state, start, end, form,
              chain, finish):
    """``walk``'s tile loop split over two warpgroups (tiles in order, descending if
    ``reverse``; the j-th walked in slot j % 2; here "tile j" is the j-th walked): warpgroup 1
    forms tile j (``form(i, slot)``, i its index: the work that needs the tile's inputs only)
    and signals ``ready[slot]``, then waits for ``done`` of tile j − 1 and finishes it
    (``finish(i, slot)``: its outputs, sent in one commit group; then the copies of tile j + 1
    go into that slot); warpgroup 0 runs the carry's chain, ``chain(i, slot, carry)`` ->
    carry, as soon as tile j is formed, and signals ``done[slot]``. So tile j's chain overlaps
    tile j − 1's finishing and tile j + 1's forming. A slot's buffers are reused two tiles
    later, inputs and outputs alike (an output may be written over an input tile): warpgroup
    1 issues the copies of tile j + 1 once tile j − 1's outputs have been read by their
    copies, and warpgroup 0 writes a slot's outputs only after ``ready``. The carry enters
    from the GMEM ref ``start`` and leaves to ``end`` (None: not stored) as ``walk``'s."""
    at = (lambda j: n_tiles - 1 - j) if reverse else (lambda j: j)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _chain():
        plgpu.copy_gmem_to_smem(start, state, start_bar)
        plgpu.barrier_wait(start_bar)

        def body(j, carry):
            slot = lax.rem(j, 2)
            plgpu.barrier_wait(in_bar.at[slot])
            with jax.named_scope("wait_in"):
                plgpu.barrier_wait(ready.at[slot])
            carry = chain(at(j), slot, carry)
            plgpu.commit_smem()  # every thread's rows are written before the signal
            plgpu.barrier_arrive(done.at[slot])
            return carry

        carry = lax.fori_loop(0, n_tiles, body, plgpu.load(state, layout=VEC))
        if end is not None:
            state[...] = carry
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state, end)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _forms_and_finishes():
        for j in range(min(2, n_tiles)):
            issue(at(j), j)

        def body(m, _):
            @pl.when(m < n_tiles)
            def _form():
                slot = lax.rem(m, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                form(at(m), slot)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready.at[slot])

            @pl.when(m > 0)
            def _finish():
                slot = lax.rem(m - 1, 2)
                with jax.named_scope("wait_chain"):
                    plgpu.barrier_wait(done.at[slot])
                finish(at(m - 1), slot)

                @pl.when(m + 1 < n_tiles)
                def _next():
                    with jax.named_scope("wait_out"):  # the outputs just sent were read
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    issue(at(m + 1), slot)

        lax.fori_loop(0, n_tiles + 1, body, None)
        plgpu.wait_smem_to_gmem(0)


def walk_tiles(warpgroups, n_tiles, reverse, issue, in_bar, pair_bars, start_bar, state, start,
               end, form, chain, outputs, store_tile):
    """A kernel's tile loop on one warpgroup (``walk``: ``form``, ``chain`` and ``outputs`` of
    each tile in turn) or on two (``walk_pair``, its barriers ``pair_bars`` = (ready, done):
    the chain on one, the forming and the outputs, then ``store_tile``, on the other)."""
    if warpgroups == 1:
        def run_tile(i, slot, carry):
            form(i, slot)
            carry = chain(i, slot, carry)
            outputs(i, slot)
            return carry

        walk(n_tiles, reverse, issue, in_bar, start_bar, state, start, end, run_tile, store_tile)
        return

    def finish(i, slot):
        outputs(i, slot)
        with jax.named_scope("store"):
            plgpu.commit_smem()
            store_tile(i, slot)

    walk_pair(n_tiles, reverse, issue, in_bar, *pair_bars, start_bar, state, start, end, form,
              chain, finish)


def _stage(ref, h, doc, bar, stage):
    """Document ``doc``'s row of ``ref`` [N, H, 128] by TMA into ``stage`` [128], waited for (a
    TMA destination is 128-byte aligned, a row of the padded tiles is not: run 94 failed with
    CUDA_ERROR_MISALIGNED_ADDRESS, so rows go through the stage and then each thread)."""
    plgpu.copy_gmem_to_smem(ref.at[doc.astype(jnp.int32), h], stage, bar)
    plgpu.barrier_wait(bar)


def restart(x, ref, h, doc, flag, bar, stage):
    """x (one coordinate a thread), or where ``flag`` is set document ``doc``'s row of ``ref``
    [N, H, 128] (``_stage``). Documents are rare: the copy and its barriers sit under a
    branch."""
    @pl.when(flag != 0)
    def _():
        _stage(ref, h, doc, bar, stage)

    x = jnp.where(flag_mask(flag), row(stage), x)

    @pl.when(flag != 0)
    def _():
        plgpu.commit_smem()  # every thread has read the stage before the next copy

    return x


def restart_rows(ref, h, doc, flag, rows, bar, stage):
    """Row t of ``rows`` [TILE, 128] = document ``doc[t]``'s row of ``ref`` [N, H, 128] for
    every token t whose ``flag`` is set (``_stage``), the other rows untouched."""
    plgpu.commit_smem()  # the rows' last readers are done before they are written

    def token(t, _):
        @pl.when(flag[t] != 0)
        def _():
            _stage(ref, h, doc[t], bar, stage)
            rows.at[t][...] = row(stage)
            plgpu.commit_smem()  # every thread has read the stage before the next copy

    lax.fori_loop(0, TILE, token, None)


def document_out(value, ref, h, doc, flag, buf):
    """Document ``doc``'s row of ``ref`` [N, H, 128] = ``value`` where ``flag`` is set."""
    @pl.when(flag != 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.commit_smem()  # every thread waits for the one that waited
        buf[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, ref.at[doc, h])


def flag_mask(x):
    """A per-token flag (a float row entry) as a VEC-layout mask."""
    return plgpu.layout_cast(jnp.broadcast_to(x != 0, (K_THREADS,)), VEC)


def cta_kernel(body, name, out_type, scratch, B, H, interpret, args, arrivals, warpgroups=1):
    """One CTA a (row, head) of ``warpgroups`` warpgroups with ``scratch`` plus the state
    buffer, the barriers (two tile slots of ``arrivals`` copies, one for single rows) and a
    document-state buffer; with two, also ``walk_pair``'s ``ready`` and ``done`` (one arrival
    a slot)."""
    scratch = dict(scratch, state=plgpu.SMEM((K_THREADS,), F32), start_bar=plgpu.Barrier(),
                   in_bar=plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
                   doc_buf=plgpu.SMEM((K_THREADS,), F32), stage=plgpu.SMEM((K_THREADS,), F32))
    if warpgroups == 2:
        scratch.update(ready=plgpu.Barrier(num_barriers=2), done=plgpu.Barrier(num_barriers=2))
    return kernel(body, name=name, out_type=out_type, scratch=scratch, grid=(B, H),
                  interpret=interpret, grid_names=("b", "h"), auto_barriers=False,
                  warpgroups=warpgroups)(*args)


def row(ref):
    """A [128] shared-memory row, one coordinate a thread, as float32."""
    return plgpu.load(ref, layout=VEC).astype(F32)


def padded(ref):
    """The [TILE, 128] view of a [TILE, KP] buffer (``KP``)."""
    return ref.at[:, pl.ds(0, K_THREADS)]


def slot_tile(ref, slot):
    """The [TILE, 128] view of the tile in ``slot`` of a [n, TILE, KP] buffer: one tile a
    warpgroup's tile in flight (n = 1: always the one)."""
    return padded(ref.at[slot if ref.shape[0] == 2 else 0])


def tokens(load, step, carry, interpret, reverse=False, rows=TILE):
    """carry ← step(t, load(t), carry) for the tile's tokens t < ``rows`` (descending if
    ``reverse``), the shared-memory loads of each ``GROUP`` tokens issued before the group's
    steps: a load that follows a shared-memory store in the program waits for it (ptxas cannot
    tell the addresses apart), which put a load's latency on every token's chain (run 92: ~70
    cycles a token). One token an iteration in interpret mode (XLA compiles the loop's body
    once)."""
    n = 1 if interpret else min(GROUP, rows)

    def body(i, carry):
        ts = [i * n + m for m in range(n)]
        ts = [rows - 1 - t for t in ts] if reverse else ts
        values = [load(t) for t in ts]
        for t, v in zip(ts, values):
            carry = step(t, v, carry)
        return carry

    return lax.fori_loop(0, rows // n, body, carry)


def square_rows(k_tile, S, interpret):
    """S_t = k_t ⊙ k_t (float32) for the tile's tokens, by rows (thread j its coordinate)."""
    def step(t, k_t, carry):
        S.at[t][...] = k_t * k_t
        return carry

    tokens(lambda t: row(k_tile.at[t]), step, None, interpret)


def issue(position, i, slot, bar, tiles, rows, c_ref, bufs, singles=()):
    """TMA copies of tile i into ``slot``: each (GMEM ref [B, Tp, H, 128], SMEM buffer) of
    ``tiles``, row ``rows[j]`` of the coefficients ``c_ref`` into ``bufs[j]``, and each (GMEM
    ref [B, n_tiles, H, 128], SMEM buffer) of ``singles`` (one row a tile)."""
    b, h = position
    span = pl.ds(i * TILE, TILE)
    for src, dst in tiles:
        plgpu.copy_gmem_to_smem(src.at[b, span, h], dst.at[slot], bar.at[slot])
    for n, buf in zip(rows, bufs):
        plgpu.copy_gmem_to_smem(c_ref.at[b, h, n, span], buf.at[slot], bar.at[slot])
    for src, dst in singles:
        plgpu.copy_gmem_to_smem(src.at[b, i, h], dst.at[slot], bar.at[slot])


def send(position, i, tiles, rows_ref, row_bufs, singles=(), by_rows=()):
    """TMA stores of tile i's results, one commit group: each (SMEM buffer, GMEM ref [B, Tp, H,
    128]) of ``tiles``, ``row_bufs[j]`` into row j of ``rows_ref`` [B, H, n, Tp], each (SMEM
    buffer, GMEM ref [B, n_tiles, H, 128]) of ``singles``, and each (padded SMEM tile, GMEM ref
    [B, Tp, H, 128]) of ``by_rows`` one token's row at a time (a TMA box is dense)."""
    b, h = position
    span = pl.ds(i * TILE, TILE)
    copies = [(src, dst.at[b, span, h]) for src, dst in tiles]
    copies += [(buf, rows_ref.at[b, h, j, span]) for j, buf in enumerate(row_bufs)]
    copies += [(src, dst.at[b, i, h]) for src, dst in singles]
    for src, dst in copies:
        plgpu.copy_smem_to_gmem(src, dst, commit_group=False)
    for src, dst in by_rows:
        def one(t, _, src=src, dst=dst):
            plgpu.copy_smem_to_gmem(src.at[t], dst.at[b, i * TILE + t, h], commit_group=False)
        lax.fori_loop(0, TILE, one, None)
    plgpu.commit_smem_to_gmem_group()


def doc_scratch(packed, vec):
    """The document rows' buffers (ids, first and last flags) when ``packed``."""
    return dict(doc=vec, first=vec, last=vec) if packed else {}


def tile(ref, interpret):
    """A [TILE, 128] shared-memory tile as float32 in the WGMMA layout. The buffers the sweeps
    also read or write by rows (one coordinate a thread) are loaded whole in ``inline_mgpu``
    (``state_mosaic.read``)."""
    return read(ref, interpret).astype(F32)


def row_sums(x_tile, s, interpret):
    """Σ_j X_tj s_tj [TILE] (ROWS layout) of a float32 tile in shared memory."""
    return jnp.sum(tile(x_tile, interpret) * s, axis=1)
