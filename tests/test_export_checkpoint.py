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


def test_the_streamed_safetensors_file_reads_back_as_written(tmp_path):
    """common.outputs.export.write_safetensors (header first, then each tensor as it arrives) gives a file that
    safetensors reads back with every name, dtype, shape and value, bf16 included; a tensor of another
    shape than the layout's, or one missing, is an error rather than a wrong file."""
    import pytest
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from common.outputs.export import write_safetensors

    torch.manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(7, 5),
        "norm.weight": torch.randn(5),
        "step": torch.tensor(3),
        "mask": torch.tensor([True, False, True]),
        "lm_head.weight": torch.randn(7, 5),
    }
    layout = [
        (name, tuple(t.shape), torch.bfloat16 if t.is_floating_point() else t.dtype)
        for name, t in tensors.items()
        if name != "lm_head.weight"
    ]  # a tied copy: left out
    path = tmp_path / "model.safetensors"
    write_safetensors(str(path), layout, iter(tensors.items()))
    loaded = load_file(str(path))
    assert set(loaded) == {name for name, _, _ in layout}
    for name, shape, dtype in layout:
        assert loaded[name].dtype == dtype and tuple(loaded[name].shape) == shape
        assert torch.equal(loaded[name], tensors[name].to(dtype)), name
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    with pytest.raises(RuntimeError, match="gathered with shape"):
        write_safetensors(
            str(tmp_path / "bad.safetensors"), [("embed.weight", (5, 7), torch.float32)], iter(tensors.items())
        )
    with pytest.raises(RuntimeError, match="wrote 0 of 1"):
        write_safetensors(
            str(tmp_path / "short.safetensors"), [("absent", (1,), torch.float32)], iter(tensors.items())
        )


def test_a_damaged_trainer_state_is_named_before_anything_is_written(tmp_path, capsys):
    """A checkpoint whose trainer_state.json was cut short (its step unreadable): one line, nothing written;
    before, a JSONDecodeError traceback after the export folder had been written."""
    (tmp_path / "trainer_state.json").write_text('{"step": ')
    (tmp_path / "model_files").mkdir()
    (tmp_path / "model_files" / "config.json").write_text("{}")
    assert "trainer_state.json is damaged" in error_of(capsys, tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
