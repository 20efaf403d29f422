"""SFT's exact match (common.training.evaluation.evaluate_generation) with a real chat model: an answer
that --max_new_tokens cuts before the end of its turn is counted, said in a warning and never
scored a match, and the default limit, sized from the references, leaves room for every
reference answer (issue 34, item 10: the demo YAML's max_new_tokens 3 cut "forty-seven")."""

import pytest
from conftest import load_script
from datasets import Dataset, DatasetDict
from test_chat import CPU

from common.data.chat import answer_token_counts, end_of_turn_ids, generation_references, tokenize_sft
from common.launch.errors import UsageError
from common.training.evaluation import evaluate_generation, size_max_new_tokens


# ShareGPT turns, as in the issue. SmolLM2-135M-Instruct answers the first exactly as written
# (8 tokens with <|im_end|>) and the second in a longer sentence, wrong at any limit.
CHATS = [
    [
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "The capital of France is Paris."},
    ],
    [{"from": "human", "value": "Write 83 in words."}, {"from": "gpt", "value": "eighty-three"}],
]


@pytest.fixture(scope="module")
def chat_model(real_model):
    from common.models.loading import load_model, load_tokenizer
    from common.options.arguments import ModelArguments

    model_args = ModelArguments(model_name_or_path=str(real_model))
    tokenizer = load_tokenizer(model_args)
    return load_model(model_args, tokenizer, seed=0), tokenizer


def test_answers_cut_by_max_new_tokens_are_counted_and_named_and_the_default_fits(chat_model, capsys):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model, tokenizer = chat_model
    raw = Dataset.from_list([{"conversations": chat} for chat in CHATS])
    references = generation_references(raw, raw.column_names, "conversations", None)
    tokenized = tokenize_sft(DatasetDict(train=raw, validation=raw), tokenizer, "conversations", 256, "drop", CPU())[0]
    stop_ids = end_of_turn_ids(tokenized["validation"])
    longest = max(answer_token_counts(tokenizer, references))
    assert longest == len(tokenizer("The capital of France is Paris.", add_special_tokens=False)["input_ids"]) + 1

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)
        capsys.readouterr()
        # A limit shorter than the answers, as the demo YAML's was: both cut, scored wrong, counted, said.
        assert size_max_new_tokens(3, longest, accelerator) == 3
        assert (
            f"warning: --max_new_tokens 3 is shorter than the longest reference answer ({longest} tokens with "
            f"its end of turn)"
        ) in capsys.readouterr().out
        cut = evaluate_generation(model, tokenizer, references, accelerator, 3, stop_ids, longest_answer=longest)
        assert cut == {"eval_exact_match": 0.0, "eval_generated": 2, "eval_truncated_generations": 2}
        assert (
            f"warning: 2 of 2 answers reached --max_new_tokens 3 before the end of the turn and were scored as "
            f"wrong; raise --max_new_tokens to {longest}, the longest reference answer with its end of turn, or "
            "leave it unset to size it from the references"
        ) in capsys.readouterr().out

        # Unset: sized from the references. The right answer fits; the wrong one is cut, but no fault of the limit.
        sized = size_max_new_tokens(None, longest, accelerator)
        assert sized == longest and capsys.readouterr().out == ""
        room = evaluate_generation(model, tokenizer, references, accelerator, sized, stop_ids, longest_answer=longest)
        assert room == {"eval_exact_match": 0.5, "eval_generated": 2, "eval_truncated_generations": 1}
        said = capsys.readouterr().out
        assert f"1 of 2 answers reached --max_new_tokens {longest}" in said and "longer than any reference" in said
        assert "warning" not in said
    finally:
        AcceleratorState._reset_state(True)


def test_max_new_tokens_defaults_to_sized_from_the_references():
    SFTArguments = load_script("recipes/sft.py").SFTArguments

    from common.options.ranges import check_ranges

    assert SFTArguments().max_new_tokens is None
    assert SFTArguments(max_new_tokens=5).max_new_tokens == 5
    with pytest.raises(
        UsageError,
        match=r"--max_new_tokens must be >= 1 \(unset: sized from the reference "
        r"answers\), got 0",
    ):
        check_ranges(SFTArguments(max_new_tokens=0))
