"""Tensor parallelism from the config, launched for real over gloo: tp.yaml (2 processes, one TP
pair) and fsdp_tp.yaml (4 processes: 2 FSDP shards x 2 TP).

fp32 parity: tp.yaml's pair shares 4 x accumulation 2 per step, fsdp_tp.yaml's two pairs 2 x
accumulation 2 each (global batch 8, as the single-process reference's 1 x 8), from the same
seeded model; each must reproduce the reference's per-step losses, evaluation and final weights
within FP32_TOLERANCE, each rank holding its share of the parameters (1/2, 1/4), every rank of a
TP group handed the same batch (checked in the run), and the memory account's model state as
scripts/estimate_memory.py predicts it. A checkpoint exports without launching to the same folder
as final/, which from_pretrained loads and which gives the reference's logits. Resumed from step
6 each continues exactly under its own config; tp.yaml's also under fsdp.yaml (the same DCP
files, re-sliced) and on one process (the portable rewrite), fsdp_tp.yaml's under tp.yaml (another
mesh shape), within FP32_TOLERANCE. bf16: fine-tuning a checkpoint saved in bf16 stays within the bf16 tolerance of
the single-process bf16 run and exports bf16. SFT under tp.yaml: tests/test_numerics.py; a kill -9
at a checkpoint save: tests/test_crashes.py.
"""

import json
import shutil

import pytest
import torch
import yaml
from conftest import (
    CONFIGS,
    FP32,
    REPO,
    SAVE_AT,
    STEPS,
    assert_same_hf_folder,
    causal_lm_args,
    export_checkpoint,
    flags,
    launch,
    launch_one_process,
    load_weights,
    losses,
    max_weight_difference,
    model_state_gaps,
    optimizer_state_dtypes,
    pretrained_args,
    read_metrics,
    read_run,
    tiered,
)
from test_strategies import BF16_LOSS_TOLERANCE, FP32_TOLERANCE, MODEL_STATE_TOLERANCE


RUN = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS, save_steps=SAVE_AT)
# config -> (processes, per-device batch, mesh, TP groups)
LAYOUTS = {"tp.yaml": (2, 4, {"tp": 2}, 1), "fsdp_tp.yaml": (4, 2, {"dp_shard": 2, "tp": 2}, 2)}


def assert_tensor_parallel_layout(record, config):
    processes, _, mesh, groups = LAYOUTS[config]
    assert record["world_size"] == processes and record["participating_processes"] == processes
    assert record["launched_strategy"] == ("tp" if config == "tp.yaml" else "fsdp") and record["device_mesh"] == mesh
    assert record["shared_batch_groups_checked"] == groups  # each group's ranks with the same batch
    assert record["effective_batch_size"] == 8  # each group's batch counted once


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trained(request, markov_data, tmp_path_factory):
    """(config, its fp32 run: global batch 8, accumulation 2, checkpoints at steps 6 and 12)."""
    config = request.param
    out = tmp_path_factory.mktemp(config.removesuffix(".yaml")) / "run"
    args = causal_lm_args(markov_data, out, **{**RUN, "per_device_train_batch_size": LAYOUTS[config][1]})
    launch(config, "causal_lm.py", args, launcher_args=FP32)
    return config, out


@pytest.mark.slow
@pytest.mark.parametrize("trained", tiered(LAYOUTS, ["tp.yaml"]), indirect=True)  # make test-all: fsdp_tp.yaml too
def test_tensor_parallel_matches_single_process(trained, reference):
    config, tp_run = trained
    record = read_run(tp_run)
    assert_tensor_parallel_layout(record, config)
    assert record["compute_dtype"] == "float32"
    total, local = record["total_parameters"], record["local_parameter_elements"]
    share = 1 / len(local)
    print(f"{config}: local parameter elements per rank {local} of {total}")
    assert all(0.9 * share * total <= n <= 1.1 * share * total for n in local) and sum(local) >= total
    gaps = model_state_gaps(tp_run, CONFIGS / config)
    print(
        f"{config}: model state vs estimate, largest gap per category "
        + ", ".join(f"{k} {v:.4f}" for k, v in gaps.items())
    )
    assert max(gaps.values()) < MODEL_STATE_TOLERANCE, gaps

    mine, ref = losses(tp_run), losses(reference)
    loss_gap = max(abs(a - b) / b for a, b in zip(mine, ref))
    weight_gap = max_weight_difference(tp_run / "final", reference / "final")
    evaluation, ref_evaluation = read_metrics(tp_run)[1][-1], read_metrics(reference)[1][-1]
    print(
        f"{config}: max relative loss gap {loss_gap:.2e}, max final-weight gap {weight_gap:.2e}, eval loss "
        f"{evaluation['eval_loss']:.6f} vs {ref_evaluation['eval_loss']:.6f} (fp32, accumulation 2)"
    )
    assert len(mine) == STEPS and loss_gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE
    assert evaluation["eval_tokens"] == ref_evaluation["eval_tokens"]  # every evaluation example once
    assert abs(evaluation["eval_loss"] - ref_evaluation["eval_loss"]) < FP32_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("trained", tiered(LAYOUTS, ["tp.yaml"]), indirect=True)  # make test-all: fsdp_tp.yaml too
def test_tensor_parallel_exports_the_single_process_model(trained, reference, tmp_path):
    from transformers import AutoModelForCausalLM

    config, tp_run = trained
    exported = export_checkpoint(tp_run / "checkpoints" / f"step_{STEPS}", tmp_path / "exported")
    assert_same_hf_folder(exported, tp_run / "final")
    vocab = json.loads((reference / "final" / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = [
        AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        for folder in (tp_run / "final", reference / "final")
    ]
    gap = (logits[0] - logits[1]).abs().max().item()
    print(f"{config}: final/ loaded with from_pretrained, logits gap to the single-process model {gap:.2e}")
    assert gap < 1e-4


RESUMES = {
    "tp.yaml": [("tp.yaml", 2, 4), ("fsdp.yaml", 2, 2), ("single.yaml", 1, 4)],
    "fsdp_tp.yaml": [("fsdp_tp.yaml", 4, 2), ("tp.yaml", 2, 4)],
}


@pytest.mark.slow
@pytest.mark.parametrize("trained", tiered(LAYOUTS, ["tp.yaml"]), indirect=True)  # make test-all: fsdp_tp.yaml too
def test_tensor_parallel_checkpoint_resumes(trained, markov_data, tmp_path):
    """From step 6: exactly under its own config; re-sliced by DCP under another mesh or FSDP2; rewritten
    (common.outputs.portable) for one process."""
    written_by, tp_run = trained
    for config, processes, batch in RESUMES[written_by]:
        resume(written_by, tp_run, config, processes, batch, markov_data, tmp_path / config.removesuffix(".yaml"))


def resume(written_by, tp_run, config, processes, batch, markov_data, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tp_run / "checkpoints" / f"step_{SAVE_AT}", tmp_path / "step")
    args = causal_lm_args(
        markov_data,
        out,
        **{**RUN, "per_device_train_batch_size": batch, "save_steps": 0, "resume_from_checkpoint": tmp_path / "step"},
    )
    if config == "single.yaml":  # in this process, as its launch runs it (conftest.launch_one_process)
        launch_one_process("causal_lm.py", args, launcher_args=FP32)
    else:
        launch(config, "causal_lm.py", args, launcher_args=FP32)
    assert read_run(out)["participating_processes"] == processes
    resumed, uninterrupted = losses(out), losses(tp_run)[SAVE_AT:]
    gap = max(abs(a - b) for a, b in zip(resumed, uninterrupted))
    weight_gap = max_weight_difference(out / "final", tp_run / "final")
    print(
        f"{written_by} step {SAVE_AT} resumed under {config} on {processes}: loss gap {gap:.2e}, "
        f"weight gap {weight_gap:.2e}"
    )
    assert len(resumed) == STEPS - SAVE_AT
    if config == written_by:  # the same layout: bit for bit
        assert resumed == uninterrupted and weight_gap == 0.0
    assert gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE


@pytest.mark.slow
@pytest.mark.exhaustive
def test_tied_embeddings_are_split_once_and_stay_tied(markov_data, tmp_path):
    """A model whose head is its input embeddings (tie_word_embeddings, as SmolLM2 and Llama 3.2 1B) under
    tp.yaml: the one weight is split once, by vocabulary rows (both rules split it so), and both uses read it, so
    its gradient sums both. fp32 against one process per step and in the final weights; the export keeps the tie;
    resumed from step 6 bit for bit under tp.yaml, and on one process through the portable rewrite. (The
    tokenizer's 51 words split unevenly: 26 and 25 rows.)
    (tests/test_real_model.py runs SmolLM2-135M itself under tensor parallelism over 3.)"""
    tied = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    tied["tie_word_embeddings"] = True
    (tmp_path / "tied.json").write_text(json.dumps(tied))

    def train(config, out, batch, accumulation, **extra):
        launch(
            config,
            "causal_lm.py",
            causal_lm_args(
                markov_data,
                out,
                model_config=tmp_path / "tied.json",
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation,
                max_steps=STEPS,
                save_steps=SAVE_AT,
                **extra,
            ),
            launcher_args=FP32,
        )
        return losses(out)

    alone, split = tmp_path / "alone", tmp_path / "split"
    reference, mine = train("single.yaml", alone, 8, 1), train("tp.yaml", split, 4, 2)
    record = read_run(split)
    assert record["participating_processes"] == 2 and record["total_parameters"] == read_run(alone)["total_parameters"]
    loss_gap = max(abs(a - b) / b for a, b in zip(mine, reference))
    weight_gap = max_weight_difference(split / "final", alone / "final")
    print(
        f"tied embeddings under tp.yaml: loss gap {loss_gap:.2e}, weight gap {weight_gap:.2e}, parameters per rank "
        f"{record['local_parameter_elements']} of {record['total_parameters']}"
    )
    assert loss_gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE
    assert json.loads((split / "final" / "config.json").read_text())["tie_word_embeddings"] is True
    for config, batch, accumulation in (("tp.yaml", 4, 2), ("single.yaml", 8, 1)):
        out = tmp_path / f"resumed_{config}"
        shutil.copytree(split / "checkpoints" / f"step_{SAVE_AT}", out / "checkpoints" / f"step_{SAVE_AT}")
        resumed = train(config, out, batch, accumulation, resume_from_checkpoint="latest")
        gap = max(abs(a - b) for a, b in zip(resumed, mine[SAVE_AT:]))
        print(f"  resumed at step {SAVE_AT} under {config}: loss gap {gap:.2e}")
        assert len(resumed) == STEPS - SAVE_AT and gap < FP32_TOLERANCE
        if config == "tp.yaml":
            assert resumed == mine[SAVE_AT:] and max_weight_difference(out / "final", split / "final") == 0.0


@pytest.mark.slow
@pytest.mark.exhaustive
def test_epochs_with_a_remainder_under_tensor_parallelism_step_as_one_process(tmp_path):
    """3 epochs whose batches leave a remainder of the accumulation window: a tp.yaml pair trains on one batch
    stream (its data-parallel size is 1), so it takes the single process's steps, losses and schedule (to 0 on
    the last step), and resumed one step past the first epoch boundary it continues bit for bit."""
    epochs_with_a_remainder_step_as_one_process("tp.yaml", tmp_path)


def epochs_with_a_remainder_step_as_one_process(config, tmp_path):
    """`config`'s pair (data-parallel size 1) over 3 epochs of 23 batches at accumulation 5, against one process,
    then resumed one step past the first epoch boundary."""
    from common.data.synthetic import write_markov_corpus

    data = tmp_path / "data"
    write_markov_corpus(str(data), train_docs=120, validation_docs=20, seed=0)
    args = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=5,
        max_steps=-1,
        num_train_epochs=3,
        save_steps=1,
        save_total_limit=100,
        warmup_steps=0,
        lr_scheduler_type="linear",
        eval_steps=0,
    )
    alone, split = tmp_path / "alone", tmp_path / "split"
    launch("single.yaml", "causal_lm.py", causal_lm_args(data, alone, **args), launcher_args=FP32)
    launch(config, "causal_lm.py", causal_lm_args(data, split, **args), launcher_args=FP32)
    record = read_run(split)
    batches = record["train_blocks"] // 2
    per_epoch = batches // 5
    print(f"{record['train_blocks']} blocks: {batches} batches per epoch, {per_epoch} steps, remainder {batches % 5}")
    assert batches % 5 != 0 and record["max_steps"] == read_run(alone)["max_steps"] == 3 * per_epoch
    mine, reference = read_metrics(split)[0], read_metrics(alone)[0]
    assert [r["step"] for r in mine] == [r["step"] for r in reference] == list(range(1, 3 * per_epoch + 1))
    gap = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(mine, reference))
    print(f"{config} over 3 epochs with a remainder: loss gap {gap:.2e} to one process")
    assert gap < FP32_TOLERANCE and mine[-1]["lr"] == pytest.approx(0.0, abs=1e-12)
    after_boundary = per_epoch + 1
    stopped = tmp_path / "stopped"
    shutil.copytree(
        split / "checkpoints" / f"step_{after_boundary}", stopped / "checkpoints" / f"step_{after_boundary}"
    )
    launch(
        config,
        "causal_lm.py",
        causal_lm_args(data, stopped, resume_from_checkpoint="latest", **args),
        launcher_args=FP32,
    )
    assert losses(stopped) == [r["loss"] for r in mine[after_boundary:]]
    assert max_weight_difference(stopped / "final", split / "final") == 0.0


@pytest.mark.slow
@pytest.mark.bf16
def test_tensor_parallel_bf16_fine_tuning(markov_data, bf16_checkpoint, bf16_reference, tmp_path):
    out = tmp_path / "run"
    launch(
        "tp.yaml", "causal_lm.py", pretrained_args(markov_data, bf16_checkpoint, out, **{**RUN, "save_steps": STEPS})
    )
    record = read_run(out)
    assert_tensor_parallel_layout(record, "tp.yaml")
    assert record["compute_dtype"] == "bfloat16" and record["master_weights_dtype"] == "float32"
    gap = max(abs(a - b) for a, b in zip(losses(out), losses(bf16_reference)))
    print(f"tp.yaml bf16: max loss gap to one process in bf16 {gap:.2e}")
    assert len(losses(out)) == STEPS and gap < BF16_LOSS_TOLERANCE
    assert optimizer_state_dtypes(out / "checkpoints" / f"step_{STEPS}") == {torch.float32}
    assert {t.dtype for t in load_weights(out / "final").values()} == {torch.bfloat16}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"


def launch_refused(config, args, recipe="causal_lm.py", launcher_args=None) -> str:
    result = launch(config, recipe, args, check=False, launcher_args=launcher_args, real=True)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, output[-4000:]
    print(errors[0])
    return errors[0]


@pytest.mark.slow
def test_what_tensor_parallelism_cannot_run_is_one_line(markov_data, tmp_path):
    """Launched: LoRA refused at the start in one line (the run's check, before anything is built)."""
    base = causal_lm_args(markov_data, tmp_path / "run", max_steps=1)
    assert "--use_peft under tensor parallelism" in launch_refused("tp.yaml", base + ["--use_peft", "true"])
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("final"))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_what_tensor_parallelism_cannot_run_is_one_line_beyond_lora(markov_data, tmp_path):
    """Heads that do not divide, refused when the model is split (make check-config's route: test_check_config.py)."""
    base = causal_lm_args(markov_data, tmp_path / "run", max_steps=1)
    three_heads = json.loads((REPO / "recipes/configs/tiny_llama.json").read_text())
    three_heads.update(hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    (tmp_path / "three_heads.json").write_text(json.dumps(three_heads))
    line = launch_refused("tp.yaml", base + flags(model_config=tmp_path / "three_heads.json"))
    assert "tp_size 2: the model has 3 attention heads, which do not divide by it" in line
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("final"))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_what_tensor_parallelism_cannot_run_is_one_line_beyond_the_arguments(markov_data, tmp_path):
    """A model without a plan, a mesh that is not the world, context parallelism and FSDP's RAM-efficient loading
    beside TP (make test: LoRA, above)."""
    base = causal_lm_args(markov_data, tmp_path / "run", max_steps=1)
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    line = launch_refused("tp.yaml", base + flags(model_config=tmp_path / "gpt2.json"))
    assert "GPT2LMHeadModel cannot be split for tensor parallelism" in line
    line = launch_refused("tp.yaml", base, launcher_args=["--num_processes", "4"])
    assert "parallelism_config: tp_size 2 = 2 processes but num_processes is 4" in line
    line = launch_refused("tp.yaml", base, launcher_args=["--parallelism_config_cp_size", "2"])
    assert (
        "parallelism_config_cp_size 2: context parallelism (torch's ring attention) runs under FSDP2, not "
        "MULTI_GPU" in line
    )
    fsdp_tp = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    fsdp_tp["parallelism_config"] = {"parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 2}
    (tmp_path / "fsdp_tp.yaml").write_text(yaml.safe_dump(fsdp_tp))
    line = launch_refused(tmp_path / "fsdp_tp.yaml", base)
    assert "fsdp_cpu_ram_efficient_loading: true beside parallelism_config_tp_size" in line
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("final"))


def test_a_group_handed_different_batches_is_stopped():
    """The run's own check (common.launch.mesh.check_shared_batch) on what a gather over a group of two returns:
    the other rank's fingerprints equal to this rank's, or not."""
    from accelerate.utils import ParallelismConfig

    from common.launch.mesh import check_shared_batch

    class TwoRanks:  # the accelerator's members the check reads
        num_processes, device = 2, torch.device("cpu")
        parallelism_config = ParallelismConfig(tp_size=2)

        def __init__(self, same: bool):
            self.same = same

        def gather(self, mine):
            return torch.cat([mine, mine if self.same else mine + 1])

    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    assert check_shared_batch(TwoRanks(same=True), batch) == 1
    with pytest.raises(RuntimeError, match="tensor/context/sequence-parallel group 0 were handed different batches"):
        check_shared_batch(TwoRanks(same=False), batch)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_multi_node_3d_template_matches_single_process(markov_data, reference, tmp_path):
    """multi_node_hsdp_tp.yaml filled for one machine of 8 processes: 2 replicas x 2 FSDP shards x 2 TP."""
    config = yaml.safe_load((CONFIGS / "multi_node_hsdp_tp.yaml").read_text())
    config.update(main_process_ip="127.0.0.1", num_machines=1, num_processes=8)
    config["parallelism_config"]["parallelism_config_dp_shard_size"] = 2
    (tmp_path / "hsdp_tp.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    launch(
        tmp_path / "hsdp_tp.yaml",
        "causal_lm.py",
        causal_lm_args(markov_data, out, **{**RUN, "per_device_train_batch_size": 1, "save_steps": 0}),
        launcher_args=FP32,
    )
    record = read_run(out)
    assert record["participating_processes"] == 8 and record["effective_batch_size"] == 8
    assert record["device_mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert record["shared_batch_groups_checked"] == 4
    loss_gap = max(abs(a - b) / b for a, b in zip(losses(out), losses(reference)))
    weight_gap = max_weight_difference(out / "final", reference / "final")
    print(f"multi_node_hsdp_tp.yaml on 8 processes: max relative loss gap {loss_gap:.2e}, weight gap {weight_gap:.2e}")
    assert len(losses(out)) == STEPS and loss_gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE


SFT = dict(max_steps=120, logging_steps=40, max_generation_samples=64, report_to="none")


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sft_under_tensor_parallelism_generates_the_single_process_answers(arithmetic_data, tmp_path):
    """The tiny Llama instruction-tuned for 120 steps (fp32, sft_demo.yaml) on one process and on a TP pair: the same
    exact match from greedy generation before and after (a pair splitting the prompts between its two ranks once
    summed two different prompts' halves: 0.14 where one process scored 0.36)."""
    scores = {}
    for config in ("single.yaml", "tp.yaml"):
        out = tmp_path / config.removesuffix(".yaml")
        launch(
            config,
            "sft.py",
            flags(
                config=REPO / "recipes/configs/sft_demo.yaml",
                output_dir=out,
                tokenizer_name_or_path=arithmetic_data / "tokenizer",
                train_file=arithmetic_data / "train.jsonl",
                validation_file=arithmetic_data / "validation.jsonl",
                **SFT,
            ),
            launcher_args=FP32,
        )
        scores[config] = [(e["eval_exact_match"], e["eval_generated"]) for e in read_metrics(out)[1]]
    print(f"sft exact match before, after: one process {scores['single.yaml']}, tp.yaml {scores['tp.yaml']}")
    assert scores["tp.yaml"] == scores["single.yaml"] and scores["tp.yaml"][-1][0] > 0.1


@pytest.mark.slow
@pytest.mark.exhaustive
def test_parameters_outside_the_plan_train_under_tensor_parallelism(
    markov_data, decoder_classifier, sentiment_data, tmp_path
):
    """Qwen2 (q/k/v biases split, norms whole) and a Llama classifier (its score head outside the plan) train
    under tp.yaml as on one process (fp32, the same global batch): the unsplit parameters are replicated."""
    qwen2 = {
        **json.loads((REPO / "recipes/configs/tiny_llama.json").read_text()),
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "num_key_value_heads": 2,
    }
    (tmp_path / "qwen2.json").write_text(json.dumps(qwen2))
    classify = flags(
        config=REPO / "recipes/configs/sequence_classification_demo.yaml",
        model_name_or_path=decoder_classifier,
        train_file=sentiment_data / "train.jsonl",
        validation_file=sentiment_data / "validation.jsonl",
        max_steps=6,
        eval_steps=0,
        logging_steps=1,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        torch_dtype="float32",
        save_dtype="float32",
    )
    causal = causal_lm_args(markov_data, tmp_path / "unused", max_steps=6, model_config=tmp_path / "qwen2.json")
    for name, recipe, args in (
        ("qwen2", "causal_lm.py", causal),
        ("classifier", "sequence_classification.py", classify),
    ):
        runs = {}
        for config in ("single.yaml", "tp.yaml"):  # 4 x accumulation 2 each: the pair shares its batch
            out = runs[config] = tmp_path / f"{name}_{config.removesuffix('.yaml')}"
            launch(
                config,
                recipe,
                args + flags(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2),
                launcher_args=FP32,
            )
        gap = max(abs(a - b) for a, b in zip(losses(runs["tp.yaml"]), losses(runs["single.yaml"])))
        weight_gap = max_weight_difference(runs["tp.yaml"] / "final", runs["single.yaml"] / "final")
        print(f"{name} under tp.yaml vs one process: loss gap {gap:.2e}, weight gap {weight_gap:.2e}")
        assert len(losses(runs["tp.yaml"])) == 6 and gap < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE
