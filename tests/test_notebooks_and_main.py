"""The notebook runs top to bottom and the README's main job succeeds (shortened)."""

import nbclient
import nbformat
import pytest

from precond_linattn.__main__ import main
from conftest import ROOT


def test_preconditioners_notebook_executes():
    path = ROOT / "notebooks" / "01_preconditioners.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any(o.output_type == "display_data" and "image/png" in o.data for o in outputs)


@pytest.mark.heavy
def test_main_job_short_run(capsys):
    assert main(["--length", "70", "--head-dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "PKDA" in out and "OSDN-APF" in out and "OK" in out
