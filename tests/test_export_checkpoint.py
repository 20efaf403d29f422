"""scripts/export_checkpoint.py on bad input: one line, exit 2, nothing written or changed.
(Exports of real checkpoints from every strategy are compared with the runs' final/ folders in
test_strategies.py, test_recipes.py and test_docs.py.)"""

import pytest

from conftest import export_checkpoint


def error_of(capsys, checkpoint, output_dir) -> str:
    with pytest.raises(SystemExit) as stopped:
        export_checkpoint(checkpoint, output_dir)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_not_a_checkpoint(tmp_path, capsys):
    assert "is not a complete checkpoint (no trainer_state.json)" in error_of(capsys, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoint_without_model_files(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text('{"step": 2}')
    assert "has no model_files/config.json" in error_of(capsys, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_left_as_it_is(tmp_path, capsys):
    (tmp_path / "trainer_state.json").write_text('{"step": 2}')
    (tmp_path / "model_files").mkdir()
    (tmp_path / "model_files" / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert "--output_dir" in error_of(capsys, tmp_path, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
