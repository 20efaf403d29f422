"""DPO (recipes/dpo.py): the pairs' formats and labels under a real chat template, the loss against its formula,
and the recipe under every config against one process, with the reference model held each way.

The runs: a tiny Llama built from a config, on generated preference pairs whose answers are 1 to 12
tokens long (variable-length rows), fp32, accumulation 2, two epochs of 100 pairs at a global batch
of 8 (12 steps an epoch, 4 pairs left over). Each 2-process run is compared step by step with the
same job on one process (batch 4 x accumulation 2)."""

import json
import math
import os

import pytest
import torch
from conftest import (
    FP32,
    HOST_PRECISION,
    REPO,
    flags,
    launch,
    launch_one_process,
    load_weights,
    max_weight_difference,
    read_metrics,
    read_run,
    run,
)
from conftest import OneProcess as CPU
from datasets import Dataset, DatasetDict

from common.data.preference import PairBatches, tokenize_pairs
from common.launch.errors import UsageError
from common.objectives.dpo import preference_loss


FP32_TOLERANCE = 1e-5
LOG_2 = math.log(2)


@pytest.fixture(scope="module")
def chat_tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)  # SmolLM2-135M-Instruct's own ChatML template


def tokenized(rows, tokenizer, block_size=256, max_prompt_length=None, overlong="drop"):
    raw = DatasetDict(train=Dataset.from_list(rows), validation=Dataset.from_list(rows))
    accelerator = CPU()
    datasets, counted = tokenize_pairs(raw, tokenizer, block_size, max_prompt_length, overlong, accelerator)
    return datasets["train"], counted["train"], accelerator.printed


def labelled_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([token for token, label in zip(ids, labels) if label != -100])


SYSTEM = {"role": "system", "content": "You answer with a number."}
TURNS = [
    SYSTEM,
    {"role": "user", "content": "what is 2 plus 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 7 plus 5?"},
]


def test_conversational_and_whole_chat_pairs_tokenize_alike_with_labels_on_the_answer_only(chat_tokenizer):
    """TRL's conversational rows and UltraFeedback's whole chats (a multi-turn prompt with a system turn and an
    earlier assistant turn, which is no label) give the same tokens; the labels are the answer and <|im_end|>."""
    chosen, rejected = {"role": "assistant", "content": "12"}, {"role": "assistant", "content": "It is 13."}
    trl = {"prompt": TURNS, "chosen": [chosen], "rejected": [rejected]}
    whole = {"prompt": "and 7 plus 5?", "chosen": TURNS + [chosen], "rejected": TURNS + [rejected]}
    sharegpt = {
        "chosen": [
            {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
            for m in TURNS + [chosen]
        ],
        "rejected": [
            {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
            for m in TURNS + [rejected]
        ],
    }
    rows = [tokenized([row], chat_tokenizer)[0][0] for row in (trl, whole, sharegpt)]
    assert rows[0] == rows[1] == rows[2]
    row = rows[0]
    assert labelled_text(chat_tokenizer, row["chosen_input_ids"], row["chosen_labels"]) == "12<|im_end|>"
    assert labelled_text(chat_tokenizer, row["rejected_input_ids"], row["rejected_labels"]) == "It is 13.<|im_end|>"
    rendered = chat_tokenizer.apply_chat_template(TURNS + [chosen], tokenize=False)
    assert chat_tokenizer.decode(row["chosen_input_ids"]) == rendered  # the template's own rendering

    text = tokenized([{"prompt": "7 plus 5 =", "chosen": " 12", "rejected": " 13"}], chat_tokenizer)[0][0]
    assert (
        labelled_text(chat_tokenizer, text["chosen_input_ids"], text["chosen_labels"])
        == " 12" + chat_tokenizer.eos_token
    )  # text pairs: no template, the completion and EOS


def test_long_prompts_are_cut_from_their_start_and_long_pairs_dropped_or_cut_with_counts(chat_tokenizer):
    long_prompt = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 3}]
    pairs = [
        {
            "prompt": long_prompt,
            "chosen": [{"role": "assistant", "content": "yes"}],
            "rejected": [{"role": "assistant", "content": "no " * 30}],
        },
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}],
        },
    ]
    full, counted, _ = tokenized(pairs, chat_tokenizer)
    prompt_tokens, short = (next(i for i, label in enumerate(row["chosen_labels"]) if label != -100) for row in full)
    assert counted == {} and prompt_tokens > short + 20  # (SmolLM2's template adds its system prompt to both)

    cut, counted, printed = tokenized(pairs, chat_tokenizer, max_prompt_length=short)
    assert counted == {"prompt_cut": 1} and "1 prompt cut" in printed[0]
    assert cut[0]["chosen_input_ids"] == full[0]["chosen_input_ids"][prompt_tokens - short :]  # its last tokens
    assert cut[1] == full[1]

    longest = max(len(full[0]["chosen_input_ids"]), len(full[0]["rejected_input_ids"]))
    dropped, counted, printed = tokenized(pairs, chat_tokenizer, block_size=longest - 1)
    assert counted == {"too_long": 1} and len(dropped) == 1 and dropped[0]["index"] == 1
    kept, counted, _ = tokenized(pairs, chat_tokenizer, block_size=longest - 1, overlong="truncate")
    assert counted == {"completion_cut": 1} and len(kept[0]["rejected_input_ids"]) == longest - 1

    with pytest.raises(
        UsageError,
        match=rf"row 0: the prompt is {prompt_tokens} tokens, which leaves no room for the "
        rf"answer in --block_size {short + 5}; raise --block_size or set "
        r"--max_prompt_length",
    ):
        tokenized(pairs, chat_tokenizer, block_size=short + 5)


def test_a_batch_holds_the_chosen_rows_then_the_rejected_padded():
    rows = [
        {
            "chosen_input_ids": [1, 2, 3],
            "chosen_labels": [-100, 2, 3],
            "rejected_input_ids": [1, 4],
            "rejected_labels": [-100, 4],
            "index": 7,
        },
        {
            "chosen_input_ids": [1, 5],
            "chosen_labels": [-100, 5],
            "rejected_input_ids": [1, 6, 6, 6],
            "rejected_labels": [-100, 6, 6, 6],
            "index": 2,
        },
    ]
    batch = PairBatches(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [1, 5, 0, 0], [1, 4, 0, 0], [1, 6, 6, 6]]
    assert batch["labels"].tolist() == [
        [-100, 2, 3, -100],
        [-100, 5, -100, -100],
        [-100, 4, -100, -100],
        [-100, 6, 6, 6],
    ]
    assert batch["attention_mask"].sum(1).tolist() == [3, 2, 2, 4] and batch["index"].tolist() == [7, 2]


@pytest.mark.parametrize(
    "loss_type,rpo_alpha", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("sigmoid", 0.5), ("ipo", 2.0)]
)
def test_each_loss_is_its_formula(loss_type, rpo_alpha):
    generator = torch.Generator().manual_seed(0)
    policy = tuple(-torch.rand(6, generator=generator, dtype=torch.float64) * 20 for _ in range(2))
    reference = tuple(-torch.rand(6, generator=generator, dtype=torch.float64) * 20 for _ in range(2))
    lengths = (torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([6, 5, 4, 3, 2, 1]))
    beta, smoothing = 0.2, (0.1 if loss_type == "sigmoid" else 0.0)
    losses, rewards = preference_loss(policy, reference, lengths, beta, loss_type, smoothing, rpo_alpha)
    for i in range(6):
        pc, pr, rc, rr = (float(t[i]) for t in (*policy, *reference))
        nll = -pc / int(lengths[0][i])  # the chosen answer's, per token (RPO)
        if loss_type == "ipo":
            pc, rc, pr, rr = (
                pc / int(lengths[0][i]),
                rc / int(lengths[0][i]),
                pr / int(lengths[1][i]),
                rr / int(lengths[1][i]),
            )
        z = (pc - rc) - (pr - rr)
        expected = {
            "sigmoid": -0.9 * math.log(1 / (1 + math.exp(-beta * z))) - 0.1 * math.log(1 / (1 + math.exp(beta * z))),
            "ipo": (z - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - beta * z),
        }[loss_type] + rpo_alpha * nll
        assert float(losses[i]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert float(rewards["rewards/chosen"][i]) == pytest.approx(beta * (pc - rc), rel=1e-12)
        assert float(rewards["rewards/margins"][i]) == pytest.approx(beta * z, rel=1e-12, abs=1e-12)
        assert float(rewards["rewards/accuracies"][i]) == float(pc - rc > pr - rr)


# --- bad input: one line each ------------------------------------------------------------


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


BAD_PAIRS = {
    "missing rejected": (
        [{"prompt": "a", "chosen": "b", "answer": "c"}] * 4,
        r"preference data needs \"chosen\" and \"rejected\" columns .* rejected missing, found "
        r"\['prompt', 'chosen', 'answer'\]",
    ),
    "identical": (
        [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 3 + [{"prompt": "a", "chosen": "b", "rejected": "b"}],
        r"row 3: chosen and rejected are the same once tokenized \('b'\); a pair must differ: drop the row",
    ),
    "rejected missing in a row": (
        [
            {
                "prompt": [{"role": "user", "content": "2+2?"}],
                "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": [{"role": "assistant", "content": "5"}],
            }
        ]
        * 3
        + [
            {
                "prompt": [{"role": "user", "content": "2+2?"}],
                "chosen": [{"role": "assistant", "content": "4"}],
                "rejected": None,
            }
        ],
        r"row 3: one of chosen and rejected is text and the other is not|row 3: a conversation "
        r"is not a list",
    ),
    "prompt turns differ": (
        [
            {
                "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}],
            }
        ]
        * 4,
        r"row 0: chosen and rejected are whole conversations whose prompt turns differ",
    ),
    "prompt too long": (
        [{"prompt": "what is " * 40, "chosen": "4", "rejected": "5"}] * 4,
        r"row 0: the prompt is \d+ tokens, which leaves no room for the answer in --block_size 64",
    ),
}


def test_auto_find_batch_size_is_refused_in_one_line(pairs, tmp_path, capsys):
    from test_bad_input import error_in_process

    line = error_in_process("dpo.py", dpo_args(pairs, tmp_path / "run", auto_find_batch_size=True), capsys)
    assert line.startswith(
        "error: --auto_find_batch_size is not available here: its trial step would not count the reference model"
    ), line


@pytest.mark.parametrize("case", list(BAD_PAIRS))
def test_bad_pairs_end_the_run_in_one_line(case, real_model, tmp_path, capsys):
    from test_bad_input import error_in_process

    rows, expected = BAD_PAIRS[case]
    data = write_rows(tmp_path / "pairs.jsonl", rows)
    line = error_in_process(
        "dpo.py",
        [
            "--model_name_or_path",
            real_model,
            "--train_file",
            data,
            "--validation_file",
            data,
            "--block_size",
            64,
            "--output_dir",
            tmp_path / "run",
        ],
        capsys,
    )
    assert __import__("re").search(expected, line), line
    assert not (tmp_path / "run" / "run.json").exists()


# --- the recipe under every config ---------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from common.data.synthetic import write_preference_data

    out = tmp_path_factory.mktemp("pairs")
    write_preference_data(str(out), train=100, validation=40)
    return out


def dpo_args(data, out, **overrides) -> list[str]:
    values = {
        "config": REPO / "recipes/configs/dpo_demo.yaml",
        "tokenizer_name_or_path": data / "tokenizer",
        "train_file": data / "train.jsonl",
        "validation_file": data / "validation.jsonl",
        "output_dir": out,
        "max_steps": -1,
        "num_train_epochs": 2,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "logging_steps": 1,
        "learning_rate": 0.003,
        "warmup_steps": 2,
        "save_steps": 6,
        "per_device_eval_batch_size": 8,
        "eval_on_start": False,  # the tests read the losses and rewards: no evaluation before training
        "max_generation_samples": 0,  # nor the demo's 100 greedy answers at each evaluation (make dpo's test does)
        **overrides,
    }
    return flags(**values)


RUNS = {}


def dpo_run(pairs, tmp_path_factory, config="ddp.yaml", processes=2, **overrides) -> "os.PathLike":
    """One fp32 launch per (config, processes, flags), shared by the tests that read it."""
    key = (config, processes, tuple(sorted(overrides.items())))
    if key not in RUNS:
        out = tmp_path_factory.mktemp("dpo") / "run"
        if processes == 1:  # in this process, as single.yaml's launch runs it (conftest.launch_one_process)
            assert config == "single.yaml"
            launch_one_process("dpo.py", dpo_args(pairs, out, **{"per_device_train_batch_size": 4, **overrides}), FP32)
        else:
            launch(config, "dpo.py", dpo_args(pairs, out, **overrides), num_processes=processes, launcher_args=FP32)
        RUNS[key] = out
    return RUNS[key]


def train_rows(out):
    return [row for row in read_metrics(out)[0] if "loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,extra",
    [
        pytest.param("ddp.yaml", {}, marks=pytest.mark.exhaustive),
        pytest.param("fsdp.yaml", {}, marks=pytest.mark.exhaustive),
        pytest.param("zero2.yaml", {}, marks=pytest.mark.exhaustive),
        ("zero3.yaml", {}),  # make test: the reference held as ZeRO-3 shards the policy, precomputed scores
        pytest.param("zero3_offload.yaml", {}, marks=pytest.mark.exhaustive),
        pytest.param("ddp.yaml", {"use_peft": True}, marks=pytest.mark.exhaustive),
        pytest.param("zero3.yaml", {"use_peft": True}, marks=pytest.mark.exhaustive),
        ("fsdp.yaml", {"precompute_ref_log_probs": True}),
    ],
)
def test_dpo_matches_one_process_and_starts_at_log_2(config, extra, pairs, tmp_path_factory):
    """Before any update the policy is the reference: step 1's loss is log 2 and every reward 0. Then
    each step's loss, rewards and the final weights match one process's (fp32, 1e-5)."""
    peft = {"lora_target_modules": "all-linear"} if extra.get("use_peft") else {}
    single_extra = {k: v for k, v in extra.items() if k != "precompute_ref_log_probs"}
    out = dpo_run(pairs, tmp_path_factory, config, **extra, **peft)
    single = dpo_run(pairs, tmp_path_factory, "single.yaml", processes=1, **single_extra, **peft)
    record = read_run(out)
    assert record["world_size"] == 2 and record["participating_processes"] == 2
    assert record["effective_batch_size"] == 8 and record["max_steps"] == 24  # 2 epochs of 12 steps, 4 pairs left
    kind = "precomputed" if extra.get("precompute_ref_log_probs") else "adapters_off" if peft else "model"
    assert record["reference_model"]["kind"] == kind
    if kind == "model":  # its weights on each rank: whole, or sharded as the policy is, as estimate-memory says
        from common.planning import memory

        strategy = memory.read_strategy(str(REPO / "accelerate_configs" / config), 2, "no")
        expected = memory.reference_bytes(memory.read_model(str(out / "final"))["parameters"], strategy, 4)
        held = record["reference_model"]["parameter_bytes_per_rank"]
        print(f"{config}: the reference holds {held} bytes per rank, estimated {expected:.0f}")
        assert all(abs(b - expected) <= 0.02 * expected for b in held)
    rows, one = train_rows(out), train_rows(single)
    assert abs(rows[0]["loss"] - LOG_2) < 1e-6
    first_rewards = [abs(rows[0][key]) for key in ("rewards/chosen", "rewards/rejected", "rewards/margins")]
    if kind == "precomputed":  # scored before training in the eval batches (another padding width): float rounding
        assert max(first_rewards) < 1e-6, first_rewards
    else:
        assert max(first_rewards) == 0, first_rewards
    assert [r["step"] for r in rows] == list(range(1, 25))
    gaps = {
        key: max(abs(a[key] - b[key]) for a, b in zip(rows, one))
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")
    }
    weight_gap = max_weight_difference(out / "final", single / "final")
    print(
        f"{config} {extra}: per-step gaps {gaps}, final-weight gap {weight_gap:.2e}; loss "
        f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"
    )
    assert all(gap < FP32_TOLERANCE for gap in gaps.values()) and weight_gap < FP32_TOLERANCE
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.slow
def test_the_loss_is_the_formula_over_the_two_models_log_probs(pairs, tmp_path_factory):
    """The zero3 run's last eval_loss (the reference a copy ZeRO-3 shards as it shards the policy; the run
    test_dpo_matches_one_process_and_starts_at_log_2 compares with one process), recomputed here from its exported
    policy and the reference (the same model built again from its config and seed) with log_softmax over every
    held-out pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.models.loading import load_model
    from common.options.arguments import ModelArguments

    out = dpo_run(pairs, tmp_path_factory, "zero3.yaml")
    tokenizer = AutoTokenizer.from_pretrained(pairs / "tokenizer")
    reference = load_model(
        ModelArguments(
            model_config=str(REPO / "recipes/configs/tiny_llama.json"), tokenizer_name_or_path=str(pairs / "tokenizer")
        ),
        tokenizer,
        seed=42,
    ).eval()
    policy = AutoModelForCausalLM.from_pretrained(out / "final").eval()

    def log_prob(model, prompt, answer):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = tokenizer(text + f"{answer} <eos>", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return float(picked[len(prompt_ids) - 1 :].sum())  # the answer's tokens and its <eos>

    losses = []
    for line in (pairs / "validation.jsonl").read_text().splitlines():
        row = json.loads(line)
        z = sum(
            sign
            * (
                log_prob(policy, row["prompt"], row[side][0]["content"])
                - log_prob(reference, row["prompt"], row[side][0]["content"])
            )
            for side, sign in (("chosen", 1), ("rejected", -1))
        )
        losses.append(math.log1p(math.exp(-0.1 * z)))  # -log sigmoid(beta z), beta 0.1 (dpo_demo.yaml)
    logged = read_metrics(out)[1][-1]
    print(f"eval_loss {logged['eval_loss']:.8f} logged, {sum(losses) / len(losses):.8f} recomputed")
    assert logged["step"] == 24 and logged["eval_pairs"] == len(losses) == 40
    assert abs(logged["eval_loss"] - sum(losses) / len(losses)) < 1e-5


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_run_killed_after_a_checkpoint_resumes_bitwise_without_scoring_the_reference_again(
    pairs, tmp_path_factory, tmp_path
):
    """--precompute_ref_log_probs under ddp: every process killed (SIGKILL) once the step-12 checkpoint is
    complete, then resumed: the reference table is read, not computed again, and the final weights
    equal the uninterrupted run's bit for bit."""
    import subprocess
    import time

    from conftest import OFFLINE_ENV, launch_command
    from test_crashes import kill_everything

    uninterrupted = dpo_run(pairs, tmp_path_factory, "ddp.yaml", precompute_ref_log_probs=True)
    out = tmp_path / "run"
    command = launch_command("ddp.yaml", "dpo.py", dpo_args(pairs, out, precompute_ref_log_probs=True), FP32)
    process = subprocess.Popen(
        command,
        env={**os.environ, **OFFLINE_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step_12").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, "the run ended before its step-12 checkpoint"
    assert kill_everything(process) >= 3  # the launcher and both ranks
    table = out / "reference_log_probs.pt"
    written = table.stat().st_mtime_ns
    result = launch(
        "ddp.yaml",
        "dpo.py",
        dpo_args(pairs, out, precompute_ref_log_probs=True, resume_from_checkpoint="latest"),
        launcher_args=FP32,
    )
    assert "resumed from" in result.stdout + result.stderr
    assert table.stat().st_mtime_ns == written  # read, not computed again
    saved, again = torch.load(table), torch.load(uninterrupted / "reference_log_probs.pt")
    assert all(torch.equal(saved[split], again[split]) for split in ("train", "validation"))
    mine, theirs = load_weights(out / "final"), load_weights(uninterrupted / "final")
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 25))

    # The table belongs to these pairs: resumed with other lengths (another tokenization), it is refused in
    # one line before anything of the run changes.
    before = (out / "run.json").read_text()
    refused = launch(
        "ddp.yaml",
        "dpo.py",
        dpo_args(pairs, out, precompute_ref_log_probs=True, block_size=20, resume_from_checkpoint="latest"),
        launcher_args=FP32,
        check=False,
        real=True,  # a refusal's one line, as a launch prints it
    )
    assert (
        refused.returncode != 0
        and f"error: {table} holds the reference log-probs of other train and validation pairs than this run's"
        in refused.stderr
    )
    assert (out / "run.json").read_text() == before


@pytest.mark.slow
def test_make_dpo_as_it_ships_learns_to_prefer_the_right_answer(tmp_path):
    """`make dpo`: ddp.yaml's bf16, the demo YAML's 200 steps. Before any update the policy is the
    reference in bf16 too (step 1: log 2, rewards 0); the share of held-out pairs whose right answer the
    model itself finds likelier rises from chance to >= 0.9."""
    import shlex

    out = tmp_path / "run"
    result = run(["make", "dpo", f"ARGS={shlex.join(['--output_dir', str(out), '--logging_steps', '1'])}"])
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == HOST_PRECISION
    assert record["reference_model"]["kind"] == "model"
    rows, evals = train_rows(out), read_metrics(out)[1]
    assert abs(rows[0]["loss"] - LOG_2) < 1e-6 and rows[0]["rewards/margins"] == 0
    before, after = evals[0], evals[-1]
    print(
        f"make dpo: prefers the chosen answer {before['eval_prefers_chosen']:.3f} -> "
        f"{after['eval_prefers_chosen']:.3f}, reward accuracy {after['eval_rewards/accuracies']:.3f}"
    )
    assert before["step"] == 0 and after["step"] == 200 and after["eval_pairs"] == 200
    assert 0.2 < before["eval_prefers_chosen"] < 0.6 and after["eval_prefers_chosen"] >= 0.9
    assert f"prefers the chosen answer {before['eval_prefers_chosen']:.3f} before -> " in result.stdout
    assert after["eval_generated"] == 100 and after["eval_exact_match"] > before["eval_exact_match"]  # the task metric
    assert f"greedy answers equal to the chosen one: {before['eval_exact_match']:.3f} before -> " in result.stdout


def test_dropout_is_off_so_the_policy_scores_as_its_reference():
    """A Llama with attention dropout and a LoRA adapter with dropout, in train mode: after disable_dropout
    two forwards agree exactly (so step 1's loss is log 2 there too)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.objectives.reference import disable_dropout

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            attention_dropout=0.5,
        )
    )
    model = get_peft_model(model, LoraConfig(r=2, lora_dropout=0.5, target_modules=["q_proj", "v_proj"])).train()
    ids = torch.randint(0, 32, (2, 8))
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout on: two forwards differ
    disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp.yaml"])
@pytest.mark.exhaustive
@pytest.mark.bf16
def test_under_fp8_the_reference_scores_as_the_float8_policy(config, pairs, tmp_path):
    """`--mixed_precision fp8 --fp8_backend ao`, 2 processes, accumulation 2: accelerate's prepare turns the
    policy's linear layers into torchao's float8 ones, and the reference copy gets the same
    (common.objectives.reference):
    before the first update they score alike, so step 1's rewards are exactly 0 (a bf16 reference beside a float8
    policy gave margins of 2e-5 and 41% "accuracy" at a learning rate of 1e-9)."""
    pytest.importorskip("torchao", reason="torchao is in the test extras: make install-test")
    out = tmp_path / "run"
    launcher = ["--mixed_precision", "fp8", "--fp8_backend", "ao"]
    if config == "fsdp.yaml":
        launcher += ["--fsdp_cpu_ram_efficient_loading", "false"]
    launch(
        config,
        "dpo.py",
        dpo_args(pairs, out, max_steps=3, num_train_epochs=1, save_steps=0),
        num_processes=2,
        launcher_args=launcher,
    )
    record, rows = read_run(out), train_rows(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == "fp8"
    assert record["reference_model"]["kind"] == "model" and record["speed"]["float8_linear_layers"] == 13
    first = {key: rows[0][key] for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")}
    print(f"fp8 {config}: step 1 {first}; losses {[round(r['loss'], 4) for r in rows]}")
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0, first
    assert abs(first["loss"] - LOG_2) < 1e-6 and len(rows) == 3


@pytest.mark.parametrize("fmt, layout", [("jsonl", "text"), ("csv", "text"), ("jsonl", "chat")])
def test_pairs_whose_answers_are_dates_train_on_the_text_written(chat_tokenizer, tmp_path, fmt, layout):
    """Issue 54, item 3: pairs whose answers are all dates ("1971-05-08") were refused, read as timestamps
    (jsonl), and pairs whose answers are numbers ("4", "007") or "NA" were refused, read as numbers or nulls
    (csv): each side's labels are now the answer as written."""
    from test_data import WRITTEN, write_written

    from common.data.loading import load_raw_datasets
    from common.options.arguments import DataArguments

    path = tmp_path / f"pairs.{fmt}"
    write_written(path, layout)
    raw = load_raw_datasets(DataArguments(train_file=str(path), validation_file=str(path)), seed=0)
    datasets, counted = tokenize_pairs(raw, chat_tokenizer, 256, None, "drop", CPU())
    end = "<|im_end|>" if layout == "chat" else chat_tokenizer.eos_token
    for row, written in zip(datasets["train"], WRITTEN * 5):
        assert labelled_text(chat_tokenizer, row["chosen_input_ids"], row["chosen_labels"]) == written["chosen"] + end
        rejected = written["rejected"] or ("no" if layout == "chat" else "")
        assert labelled_text(chat_tokenizer, row["rejected_input_ids"], row["rejected_labels"]) == rejected + end


def test_a_pair_the_cut_makes_identical_is_dropped_and_counted(chat_tokenizer):
    """Issue 54, item 5: --overlong truncate stopped the run ("row 1: chosen and rejected are the same once
    tokenized ...") when the cut left a pair's two answers the same: such a pair carries no signal, so it is
    dropped and counted, as --overlong drop drops it; a pair the same before any cut still stops the run."""
    prompt = [{"role": "user", "content": "Count to ten."}]
    counting = "one two three four five six seven eight nine"
    pairs = [
        {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": "ten"}],
            "rejected": [{"role": "assistant", "content": "eleven"}],
        },
        {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": counting + " ten"}],
            "rejected": [{"role": "assistant", "content": counting + " eleven"}],
        },
    ]
    full, _, _ = tokenized(pairs, chat_tokenizer)
    shared = next(
        i for i, (a, b) in enumerate(zip(full[1]["chosen_input_ids"], full[1]["rejected_input_ids"])) if a != b
    )  # the first token where the long answers differ: a block that ends before it cuts them the same
    assert shared > len(full[0]["rejected_input_ids"])
    kept, counted, printed = tokenized(pairs, chat_tokenizer, block_size=shared, overlong="truncate")
    assert [row["index"] for row in kept] == [0] and counted == {"identical_once_cut": 1}
    assert printed[0] == (
        f"train pairs: 1 identical once cut (of 2; --block_size {shared}, --max_prompt_length None, --overlong truncate)"
    )
    dropped, counted, _ = tokenized(pairs, chat_tokenizer, block_size=shared, overlong="drop")
    assert [row["index"] for row in dropped] == [0] and counted == {"too_long": 1}
    with pytest.raises(UsageError, match="row 0: chosen and rejected are the same once tokenized"):
        tokenized(
            [{**pairs[0], "rejected": pairs[0]["chosen"]}], chat_tokenizer, block_size=shared, overlong="truncate"
        )


@pytest.mark.slow
def test_dpo_after_a_lora_sft_under_zero3_trains_the_adapter_on_against_base_plus_it(pairs, tmp_path):
    """DPO after a LoRA SFT, as the README's DPO row says it: the SFT run's final/ (an adapter, its B matrices
    trained away from zero) as --model_name_or_path with --use_peft, under zero3.yaml on 2 processes. The
    reference is base + that adapter, partitioned as the policy is: step 1's loss is log 2 and every reward
    exactly 0 (before, the adapter was dropped: policy and reference the bare base). The adapter trains on:
    final/ holds it, moved, with its own shape, on the base it names."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base, sft_final, out = tmp_path / "base", tmp_path / "sft" / "final", tmp_path / "dpo"
    tokenizer = AutoTokenizer.from_pretrained(pairs / "tokenizer")
    config = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json", vocab_size=len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(base)  # saved in bf16, as on the Hub
    tokenizer.save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(sft_final)
    tokenizer.save_pretrained(sft_final)

    from_sft = {"model_config": "", "tokenizer_name_or_path": "", "model_name_or_path": sft_final, "use_peft": True}
    args = dpo_args(pairs, out, max_steps=2, num_train_epochs=1, save_steps=0, **from_sft)
    launch("zero3.yaml", "dpo.py", args, launcher_args=FP32)
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["reference_model"]["kind"] == "model"
    assert (record["args"]["model_name_or_path"], record["args"]["lora_r"]) == (str(base), 4)
    first = train_rows(out)[0]
    assert abs(first["loss"] - LOG_2) < 1e-6
    assert [first[key] for key in ("rewards/chosen", "rewards/rejected", "rewards/margins")] == [0, 0, 0]
    saved = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (saved["base_model_name_or_path"], saved["r"]) == (str(base), 4)
    before, after = (
        load_file(sft_final / "adapter_model.safetensors"),
        load_file(out / "final/adapter_model.safetensors"),
    )
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
