"""lightning_opd.files: strict-JSON values for results with empty turns."""

import json
import math

from lightning_opd.files import json_safe


def test_json_safe_writes_non_finite_floats_as_null_at_any_depth():
    data = {"mean": math.nan, "per_turn": [0.5, math.inf, (-math.inf, 2)], "n": 3, "name": "x"}
    assert json_safe(data) == {"mean": None, "per_turn": [0.5, None, [None, 2]], "n": 3, "name": "x"}
    assert json.loads(json.dumps(json_safe(data), allow_nan=False))["per_turn"][2] == [None, 2]


def test_json_safe_leaves_finite_values_unchanged():
    assert json_safe({"a": [1.25, 0, True, None]}) == {"a": [1.25, 0, True, None]}


def test_write_text_atomic_creates_folders_replaces_whole_and_leaves_no_temporary(tmp_path):
    from lightning_opd.files import write_text_atomic

    path = tmp_path / "a" / "b" / "out.json"
    assert write_text_atomic(path, "first") == path
    write_text_atomic(str(path), "second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]
