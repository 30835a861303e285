"""issue 36 item 1: a container-chosen cell cannot make a table huge."""
from orchestrator.core import report


def test_huge_first_cell_does_not_pad_every_row():
    rows = [["x" * (1 << 20), "a", "b"]] + [[f"c{i}", "a", "FAIL"] for i in range(50)]
    out = report.table(rows, ["check", "v", "verdict"])
    assert len(out) < 200_000, len(out)
    assert "more chars cut" in out


def test_huge_middle_and_last_cells_are_capped():
    rows = [["n", "y" * (1 << 20), "z" * (1 << 20)]]
    for width in (None, 100):
        out = report.table(rows, ["check", "v", "reason"], width)
        assert len(out) < 20_000, len(out)
