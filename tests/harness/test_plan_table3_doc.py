"""``docs/plan_table3.{md,json}`` are what the planner gives now (``paper_table3_plan.py``)."""

from __future__ import annotations


def test_plan_table3_is_generated_from_the_planner(monkeypatch, tmp_path):
    from benchmarks import paper_table3_plan as t3

    assert t3.main(["--check"]) == 0, "run: python benchmarks/paper_table3_plan.py"
    # a stale file is found: a copy with one number changed
    for name in ("plan_table3.md", "plan_table3.json"):
        (tmp_path / name).write_text((t3.OUT / name).read_text())
    md = tmp_path / "plan_table3.md"
    md.write_text(md.read_text().replace("| expert |", "| token |", 1))
    monkeypatch.setattr(t3, "OUT", tmp_path)
    assert t3.main(["--check"]) == 1
