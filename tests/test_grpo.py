"""GRPO (recipes/grpo.py): the objective against hand-written formulas, the rewards and their one-line failures,
rollouts that depend on (seed, rollout, prompt) only, every config against one process in fp32, resume inside
--num_iterations, `make grpo`, bad input."""

import contextlib
import json
import math
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    FP32,
    HOST_PRECISION,
    REPO,
    LaunchedOnce,
    flags,
    free_port,
    launch,
    load_weights,
    max_weight_difference,
    read_metrics,
    read_run,
    run,
    run_in_process,
    run_make_warm,
    tiered,
)

from common.launch.errors import UsageError
from common.objectives.grpo import Normaliser, group_advantages, leave_one_out_advantages, policy_loss, rloo_loss
from common.objectives.rewards import load_rewards, score
from common.objectives.rollout import InverseCdfSampler, Rollout


FP32_TOLERANCE = 1e-5


# ---- the objective ---------------------------------------------------------------------------------------------
def test_group_advantages_follow_each_scaling():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])
    std = torch.tensor([0.5, 0.0]).repeat_interleave(4)  # unbiased: sqrt(0.75 / 3)
    advantages, stds = group_advantages(rewards, 4, "group")
    assert torch.allclose(stds, std)  # what each advantage was divided by: TRL's frac_reward_zero_std reads it
    assert torch.allclose(advantages, centred / (std + 1e-4))
    assert torch.allclose(group_advantages(rewards, 4, "none")[0], centred)
    batch_std = rewards.std()
    advantages, stds = group_advantages(rewards, 4, "batch", batch_std)
    assert torch.allclose(advantages, centred / (batch_std + 1e-4))
    assert torch.allclose(stds, batch_std.expand(8))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_completion_no_function_scored_is_left_out_of_its_group_and_gets_no_advantage(scale):
    """TRL's rule: [1, None, 0, 1, None, 0, 0, 1] has the mean and std of its six scored rewards, and the unscored
    two advantage 0 (taken as reward 0 before: [1.21, -0.72, -0.72, ...] against TRL's [0.91, 0, -0.91, ...]);
    a group with one scored completion has no std: advantage 0 throughout, as TRL's NaN made 0."""
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 1.0, nan, 0.0, 0.0, 1.0, 3.0, nan, nan, nan])
    batch_std = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 3.0]).std()  # the scored ones
    advantages, _ = group_advantages(rewards[:8], 8, scale, batch_std)
    divisor = {"group": math.sqrt(0.3) + 1e-4, "batch": float(batch_std) + 1e-4, "none": 1.0}[scale]
    expected = torch.tensor([0.5, 0.0, -0.5, 0.5, 0.0, -0.5, -0.5, 0.5]) / divisor
    assert torch.allclose(advantages, expected, atol=1e-6), advantages
    if scale == "group":
        assert [round(a, 2) for a in advantages.tolist()[:3]] == [0.91, 0.0, -0.91]
    alone, _ = group_advantages(rewards[8:], 4, scale, batch_std)
    assert alone.tolist() == [0.0] * 4


@pytest.mark.parametrize("model_config", ["tiny_llama.json", "tiny_qwen3.json"])
def test_the_head_scores_only_completion_positions_and_the_figures_equal_every_positions(prompts, model_config):
    """token_log_probs runs the LM head on the positions that predict a completion token only (transformers'
    logits_to_keep) and each row's fp32 log-softmax on its own completion positions, SCORED_CHUNK at a time: on
    right-padded rows of prompts and completions of different lengths (one completion longer than a chunk), the
    log-probabilities, their gradient and the entropies equal those of the whole logits scored at every position (as
    before), in fp32 and under bf16 autocast; the head saw fewer positions than the rows hold."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from common.objectives import grpo

    tokenizer = AutoTokenizer.from_pretrained(prompts / "tokenizer")
    config = AutoConfig.from_pretrained(REPO / "recipes/configs" / model_config, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(3)
    rows = [
        {"prompt_ids": torch.randint(3, len(tokenizer), (p,), generator=generator).tolist(),
         "completion_ids": torch.randint(3, len(tokenizer), (c,), generator=generator).tolist(), "truncated": False}
        for p, c in ((9, 4), (14, 7), (6, 1), (11, 12))
    ]  # fmt: skip
    batch = Rollout(0, rows, torch.zeros(len(rows))).batch(rows, tokenizer.pad_token_id or 0, False)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))

    def every_position(temperature):  # as token_log_probs scored before: the whole logits, every position
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        log_probs = (logits.float() / temperature).log_softmax(-1)
        labels = batch["labels"][:, 1:]
        picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        probs = log_probs.detach().exp()
        return torch.where(labels != -100, picked, 0.0), -torch.special.xlogy(probs, probs).sum(-1)

    for precision in ("fp32", "bf16"):
        autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")
        grpo.SCORED_CHUNK, original = 5, grpo.SCORED_CHUNK  # the longest completion's positions in three chunks
        try:
            model.zero_grad()
            entropies = []
            with autocast:
                ours = grpo.token_log_probs(model, batch, 0.7, entropies)
            ours.sum().backward()
            our_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        finally:
            grpo.SCORED_CHUNK = original
        assert seen[-1] == int((batch["labels"][:, 1:] != -100).any(0).sum()) < batch["input_ids"].shape[1] - 1
        model.zero_grad()
        with autocast:
            theirs, entropy = every_position(0.7)
        theirs.sum().backward()
        their_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        mask = batch["mask"]
        gaps = [
            float((ours - theirs).abs().max()),
            float(((entropies[0] - entropy) * mask).abs().max()),
            float((our_grad - their_grad).abs().max() / their_grad.abs().max()),
        ]
        print(f"{model_config} {precision}: log-probs, entropy, gradient (relative) differ by {gaps}")
        assert ours.shape == theirs.shape and bool((ours[~mask] == 0).all())
        assert max(gaps) < (1e-5 if precision == "fp32" else 2e-2), gaps
        assert float(((entropies[0] != 0) & ~mask).sum()) == 0


@pytest.mark.slow
def test_the_loss_and_its_gradient_are_trls_own_with_the_kl_bias_correction_on_and_off():
    """TRL 1.16's own GRPOTrainer._compute_loss (installed as make benchmark-peers installs it) against policy_loss on
    the same log-probabilities (off-policy, completions of different lengths): with --beta, use_bias_correction_kl on
    (TRL's default and ours) and off, token and sequence ratios, with and without delta, the grpo and bnpo averages,
    the loss and its gradient within 1e-6 of TRL's (benchmarks/peers/trl_loss_check.py); the correction changes the
    gradient, so the comparison could fail."""
    run(["make", "-s", ".venv/.installed-trl"])
    result = run([sys.executable, "benchmarks/peers/trl_loss_check.py"])
    cases = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 32, result.stdout
    for case in cases:
        assert case["loss_gap"] < 1e-6 and case["grad_gap"] < 1e-6, case
    scales = {(c["bias_correction_kl"], c["level"], c["delta"], c["loss_type"]): c["grad_scale"] for c in cases
              if c["beta"]}  # fmt: skip
    assert all(abs(scales[(True, *key)] - scales[(False, *key)]) > 1e-6 for (on, *key) in scales if on)


def test_training_scores_each_token_at_the_temperature_it_was_sampled_at(prompts):
    """At T = 0.7 the log-probabilities stored for --num_iterations (and the policy's and the reference's, the same
    function) equal those of the distribution each token was drawn from, within float rounding (scored at 1 they
    were 0.30 nats off on average); the dapo gradient is the hand computation at logits / T."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from common.objectives.grpo import rollout_log_probs, token_log_probs

    tokenizer = AutoTokenizer.from_pretrained(prompts / "tokenizer")
    config = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json", vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = tokenizer("what is 3 plus 4 ?")["input_ids"]
    group, length, temperature = 4, 6, 0.7
    uniforms = torch.rand(group, length, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sampler = InverseCdfSampler(uniforms, len(prompt), temperature, 1.0, [])
    output = torch.tensor([prompt] * group)
    with torch.no_grad():  # generate's greedy loop over the sampler's scores, with no other logits processor
        for _ in range(length):
            scores = sampler(output, model(input_ids=output).logits[:, -1])
            output = torch.cat([output, scores.argmax(-1, keepdim=True)], 1)
    drawn = torch.stack(sampler.log_probs, 1)  # (rows, positions): the sampler's own, in float64
    rows = [
        {"row": 0, "prompt_ids": prompt, "completion_ids": ids, "truncated": True}
        for ids in output[:, len(prompt) :].tolist()
    ]
    rollout = Rollout(0, rows, torch.zeros(group))
    cpu = SimpleNamespace(device="cpu", autocast=contextlib.nullcontext)
    stored = torch.tensor(rollout_log_probs(model, rollout, group, 0, cpu, temperature), dtype=torch.float64)
    assert (stored - drawn).abs().max() < 1e-5, (stored - drawn).abs().max()
    at_one = torch.tensor(rollout_log_probs(model, rollout, group, 0, cpu), dtype=torch.float64)
    assert (at_one - drawn).abs().mean() > 0.01  # what the training scored before: another distribution

    # the gradient of dapo's loss with respect to the logits, against -A / N (onehot(y) - softmax(z / T)) / T
    batch = next(rollout.micro_batches(group, 0, False, "cpu"))
    logits = model(input_ids=batch["input_ids"]).logits.detach().requires_grad_()
    as_model = lambda **_: SimpleNamespace(logits=logits)  # noqa: E731
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0])
    tokens = float(batch["mask"].sum())
    loss, _ = policy_loss(
        token_log_probs(as_model, batch, temperature), None, None, advantages, batch["mask"],
        Normaliser(group, tokens, 1), "dapo", 0.2, 0.2, 0.0, length,
    )  # fmt: skip
    loss.backward()
    targets = batch["labels"][:, 1:]
    probs = (logits.detach()[:, :-1] / temperature).softmax(-1)
    hand = -(F.one_hot(targets.clamp(min=0), probs.shape[-1]) - probs) / temperature
    hand = hand * (advantages[:, None, None] * batch["mask"][..., None] / tokens)
    assert (logits.grad[:, :-1] - hand).abs().max() < 1e-6


def test_rloos_kl_penalty_is_each_completions_sum_of_its_sampling_log_ratios(prompts):
    """rollout_kl, RLOO's penalty: each completion's sum over its tokens of logp_policy - logp_reference (k1) at the
    sampling temperature, the policy's log-probabilities being those the sampler drew each token with; the kl
    figure their token mean; a truncated completion counts nothing under --mask_truncated_completions."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from common.objectives.grpo import rollout_kl
    from common.objectives.reference import Reference

    tokenizer = AutoTokenizer.from_pretrained(prompts / "tokenizer")
    config = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json", vocab_size=len(tokenizer))
    torch.manual_seed(0)
    policy, other = AutoModelForCausalLM.from_config(config).eval(), AutoModelForCausalLM.from_config(config).eval()
    prompt = tokenizer("what is 3 plus 4 ?")["input_ids"]
    group, length, temperature = 4, 5, 0.7
    uniforms = torch.rand(group, length, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sampler = InverseCdfSampler(uniforms, len(prompt), temperature, 1.0, [])
    output = torch.tensor([prompt] * group)
    with torch.no_grad():
        for _ in range(length):
            scores = sampler(output, policy(input_ids=output).logits[:, -1])
            output = torch.cat([output, scores.argmax(-1, keepdim=True)], 1)
        drawn = torch.stack(sampler.log_probs, 1)  # the policy's, as sampled
        theirs = (other(input_ids=output).logits[:, len(prompt) - 1 : -1].double() / temperature).log_softmax(-1)
    theirs = theirs.gather(-1, output[:, len(prompt) :].unsqueeze(-1)).squeeze(-1)
    rows = [{"row": 0, "prompt_ids": prompt, "completion_ids": ids, "truncated": i == 1}
            for i, ids in enumerate(output[:, len(prompt) :].tolist())]  # fmt: skip
    cpu = SimpleNamespace(device="cpu", autocast=contextlib.nullcontext)
    reference = Reference("model", other)
    reference.accelerator = cpu
    kl, (total, tokens) = rollout_kl(policy, reference, Rollout(0, rows, torch.zeros(group)), 2, 0, cpu, 0.7, False)
    expected = (drawn - theirs).sum(1)
    assert (kl.double() - expected).abs().max() < 1e-4 and expected.abs().min() > 1e-2, (kl, expected)
    assert tokens == group * length and total == pytest.approx(float(expected.sum()), abs=1e-3)
    masked, _ = rollout_kl(policy, reference, Rollout(0, rows, torch.zeros(group)), 2, 0, cpu, 0.7, True)
    assert masked[1] == 0 and torch.equal(masked[[0, 2, 3]], kl[[0, 2, 3]])


def hand_loss(log_probs, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_length, rows, tokens,
              level="token", delta=None, correction=True):  # fmt: skip
    """The per-token GRPO loss written out element by element, then reduced as each loss type says. `level`
    "sequence" (GSPO): each token takes its completion's ratio, exp of the mean of its tokens' log-ratios; `delta`
    caps the ratio in the unclipped term; `correction` (TRL's use_bias_correction_kl): the k3 term times the ratio,
    before delta's cap."""
    per_row = []
    for i in range(log_probs.shape[0]):
        terms = []
        kept = [t for t in range(log_probs.shape[1]) if mask[i, t]]
        sequence_log_ratio = sum(float(log_probs[i, t] - old[i, t]) for t in kept) / max(len(kept), 1)
        for t in kept:
            log_ratio = sequence_log_ratio if level == "sequence" else float(log_probs[i, t] - old[i, t])
            ratio = importance = math.exp(log_ratio)
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            ratio = ratio if delta is None else min(ratio, delta)
            term = -min(ratio * float(advantages[i]), clipped * float(advantages[i]))
            if beta:
                gap = float(ref[i, t] - log_probs[i, t])
                term += beta * (torch.exp(torch.tensor(gap)).item() - gap - 1) * (importance if correction else 1)
            terms.append(term)
        per_row.append(terms)
    if loss_type == "grpo":
        return sum(sum(t) / len(t) for t in per_row) / rows
    total = sum(sum(t) for t in per_row)
    return {"dapo": total / tokens, "dr_grpo": total / (rows * max_length), "bnpo": total / tokens}[loss_type]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_each_loss_type_is_its_formula(loss_type, beta):
    """One micro-batch holding the whole global batch (shares 1): the loss equals the hand-written sum, with the
    ratio clipped on both sides (epsilon 0.2, epsilon_high 0.28) and the k3 KL term under beta."""
    generator = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(3, 5, generator=generator) * 2
    old = log_probs + (torch.rand(3, 5, generator=generator) - 0.5)  # ratios from 0.6 to 1.6: both clips hit
    ref = log_probs + (torch.rand(3, 5, generator=generator) - 0.5)
    advantages = torch.tensor([1.5, -0.7, 0.2])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    tokens = int(mask.sum())
    for correction in (False, True) if beta else (True,):  # TRL's use_bias_correction_kl off and on (its default)
        loss, values = policy_loss(
            log_probs, old, ref if beta else None, advantages, mask, Normaliser(3.0, float(tokens), 1),
            loss_type, 0.2, 0.28, beta, 8, bias_correction_kl=correction,
        )  # fmt: skip
        expected = hand_loss(log_probs, old, ref, advantages, mask, loss_type, 0.2, 0.28, beta, 8, 3, tokens,
                             correction=correction)  # fmt: skip
        assert abs(float(loss) - expected) < 1e-6, (correction, float(loss), expected)
    ratio = torch.exp(log_probs - old)
    signs = advantages.unsqueeze(1).expand(3, 5)
    low, high = (ratio < 0.8) & (signs < 0) & mask, (ratio > 1.28) & (signs > 0) & mask

    def reduced(name):  # as MetricsLogger.record_per_call takes it on one rank
        how, value, count = values[name]
        return how, float(value) / float(count)

    assert reduced("clip_ratio/low_mean") == ("pooled", pytest.approx(float(low.sum() / mask.sum())))
    assert reduced("clip_ratio/high_mean") == ("pooled", pytest.approx(float(high.sum() / mask.sum())))
    # TRL's low_min and high_max: the extremes over the completions of each one's own share of clipped tokens
    per_row_low, per_row_high = low.sum(1) / mask.sum(1), high.sum(1) / mask.sum(1)
    assert reduced("clip_ratio/low_min") == ("min", pytest.approx(float(per_row_low.min())))
    assert reduced("clip_ratio/high_max") == ("max", pytest.approx(float(per_row_high.max())))
    assert ("kl" in values) == bool(beta)


def variant_batch():
    """Three completions whose ratios reach both clips, token by token and as whole completions."""
    generator = torch.Generator().manual_seed(3)
    log_probs = -torch.rand(3, 5, generator=generator) * 2
    old = log_probs + (torch.rand(3, 5, generator=generator) - 0.5) * 1.2
    ref = log_probs + (torch.rand(3, 5, generator=generator) - 0.5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    return log_probs, old, ref, torch.tensor([1.5, -0.7, 0.4]), mask


@pytest.mark.parametrize("level,delta", [("sequence", None), ("sequence", 1.1), ("token", 1.1)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_and_two_sided_clipping_are_their_formulas(level, delta, loss_type, beta):
    """TRL's --importance_sampling_level sequence (GSPO: one ratio per completion, from the mean of its tokens'
    log-ratios, taken by each of its tokens) and --delta (the ratio capped in the unclipped term) against the loss
    written out token by token; at the sequence level the clip figures count completions, as TRL's."""
    log_probs, old, ref, advantages, mask = variant_batch()
    tokens = int(mask.sum())
    loss, values = policy_loss(
        log_probs, old, ref if beta else None, advantages, mask, Normaliser(3.0, float(tokens), 1), loss_type, 0.2,
        0.28, beta, 8, importance_sampling_level=level, delta=delta,
    )  # fmt: skip
    expected = hand_loss(log_probs, old, ref, advantages, mask, loss_type, 0.2, 0.28, beta, 8, 3, tokens, level,
                         delta)  # fmt: skip
    assert abs(float(loss) - expected) < 1e-6, (float(loss), expected)
    plain = hand_loss(log_probs, old, ref, advantages, mask, loss_type, 0.2, 0.28, beta, 8, 3, tokens)
    assert abs(plain - expected) > 1e-3  # the variant changes the loss on this batch: the check could fail
    mean_log_ratio = ((log_probs - old) * mask).sum(1) / mask.sum(1)
    if level == "sequence":
        ratio = mean_log_ratio.exp().clamp(max=delta or math.inf)
        low, high = (ratio < 0.8) & (advantages < 0), (ratio > 1.28) & (advantages > 0)
        how, count, rows = values["clip_ratio/low_mean"]
        assert (how, float(count) / rows) == ("pooled", float(low.float().mean()))
        assert float(values["clip_ratio/high_max"][1]) == float(high.float().max())
        reached = mean_log_ratio.exp() > delta if delta else low | high  # the cap, or a clip, acts on this batch
        assert reached.any(), mean_log_ratio.exp()


def test_rloo_advantages_are_the_leave_one_out_baseline_of_the_scored():
    """TRL's RLOOTrainer: each reward minus the mean of its group's other scored rewards; an unscored completion, and
    one alone in its group, have none (NaN here, 0 once normalised); the group's std is frac_reward_zero_std's."""
    nan = math.nan
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, nan, 0.0, 1.0, 3.0, nan, nan, nan])
    advantages, stds = leave_one_out_advantages(rewards, 4)
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5, nan, -1.0, 0.5, nan, nan, nan, nan]
    assert advantages.tolist() == pytest.approx(expected, nan_ok=True)
    assert stds[:8].tolist() == pytest.approx([float(rewards[:4].std())] * 4 + [float(rewards[[4, 6, 7]].std())] * 4)
    # the same as G / (G - 1) x the group-mean advantage on a fully scored group
    assert advantages[:4].tolist() == pytest.approx((4 / 3 * group_advantages(rewards[:4], 4, "none")[0]).tolist())


def test_rloos_loss_is_the_clipped_ratio_of_whole_completions():
    """TRL's RLOOTrainer: exp(sum of the completion's log-probs - the sampling policy's sum), clipped, one loss per
    completion averaged over the global batch's completions, whatever the split into micro-batches; the clip figures
    count completions."""
    log_probs, old, _, advantages, mask = variant_batch()
    log_probs.requires_grad_(True)
    loss, values = rloo_loss(log_probs, old, None, advantages, mask, Normaliser(3.0, 12.0, 1), 0.2, 0.28)
    ratios = [math.exp(float(((log_probs[i] - old[i]) * mask[i]).sum())) for i in range(3)]
    hand = [-min(r * float(a), min(max(r, 0.8), 1.28) * float(a)) for r, a in zip(ratios, advantages)]
    assert abs(float(loss) - sum(hand) / 3) < 1e-6, (float(loss), hand)
    assert any(r < 0.8 or r > 1.28 for r in ratios) and any(0.8 <= r <= 1.28 for r in ratios)
    loss.backward()  # each completion's gradient is its own sum of log-probs' unless clipped: ratio x advantage / 3
    for i, (r, a) in enumerate(zip(ratios, advantages.tolist())):
        unclipped = (r * a <= min(max(r, 0.8), 1.28) * a) or 0.8 <= r <= 1.28
        assert log_probs.grad[i].tolist() == pytest.approx((-(r * a) / 3 * mask[i] * unclipped).tolist(), abs=1e-6)
    low = [r < 0.8 and a < 0 for r, a in zip(ratios, advantages.tolist())]
    assert float(values["clip_ratio/low_mean"][1]) / values["clip_ratio/low_mean"][2] == pytest.approx(sum(low) / 3)
    halves = [rloo_loss(log_probs[i : i + 1], old[i : i + 1], None, advantages[i : i + 1], mask[i : i + 1],
                        Normaliser(3.0, 12.0, 3), 0.2, 0.28)[0] for i in range(3)]  # fmt: skip
    assert abs(float(sum(halves) / 3) - float(loss)) < 1e-6  # three shares, averaged as accelerate does


def test_the_loss_is_the_global_batchs_whatever_the_split():
    """dapo, grpo and dr_grpo: a batch split into 2 ranks x 2 micro-batches, each share's loss averaged as
    accelerate and the strategy average them, gives the loss of the batch taken whole (bnpo, TRL's local
    normalisation, does not: it is documented as split-dependent)."""
    generator = torch.Generator().manual_seed(1)
    log_probs = -torch.rand(8, 6, generator=generator)
    old = log_probs + (torch.rand(8, 6, generator=generator) - 0.5) * 0.2
    advantages = torch.randn(8, generator=generator)
    mask = torch.rand(8, 6, generator=generator) > 0.3
    mask[:, 0] = True
    whole = Normaliser(8.0, float(mask.sum()), 1)
    split = Normaliser(8.0, float(mask.sum()), 4)
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        args = (loss_type, 0.2, 0.2, 0.0, 6)
        full, _ = policy_loss(log_probs, old, None, advantages, mask, whole, *args)
        parts = [policy_loss(log_probs[i : i + 2], old[i : i + 2], None, advantages[i : i + 2], mask[i : i + 2],
                             split, *args)[0] for i in range(0, 8, 2)]  # fmt: skip
        assert abs(float(sum(parts) / 4) - float(full)) < 1e-6, loss_type


# ---- rewards ---------------------------------------------------------------------------------------------------
def test_the_built_in_rewards_and_their_weights():
    functions, names, weights = load_rewards(["accuracy", "format", "length"], [1.0, 0.5, 0.1], r"-?\d+", 8, "cpu",
                                             torch.float32)  # fmt: skip
    completions = ["12", "the sum is 12.0", "13", "twelve"]
    table, problem = score(functions, names, ["q"] * 4, completions, [[1], [1, 2, 3, 4], [1, 2], [1]],
                           {"answer": ["12", "12", "12", "12"]}, [0, 1, 2, 3])  # fmt: skip
    assert problem is None and names == ["accuracy", "format", "length"]
    assert table[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # the last number, as numbers
    assert table[:, 1].tolist() == [1.0, 0.0, 1.0, 0.0]  # the whole answer a bare number
    assert table[:, 2].tolist() == [1 - 1 / 8, 1 - 4 / 8, 1 - 2 / 8, 1 - 1 / 8]
    combined = (table * torch.tensor(weights, dtype=table.dtype)).sum(1)
    assert combined[0] == pytest.approx(1 + 0.5 + 0.1 * 7 / 8)


def user_rewards(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            import math

            def ends_with_answer(prompts, completions, answer, **kwargs):
                return [1.0 if c[-1]["content"].strip().endswith(a) else None for c, a in zip(completions, answer)]

            def raises(completions, **kwargs):
                raise KeyError("score")

            def one_short(completions, **kwargs):
                return [0.0] * (len(completions) - 1)

            def not_finite(completions, **kwargs):
                return [0.0] * (len(completions) - 1) + [math.nan]

            def no_kwargs(completions):
                return [0.0] * len(completions)

            async def async_no_kwargs(completions):
                return [0.0] * len(completions)
            """
        )
    )
    return path


def test_a_users_function_takes_trls_signature_and_none_is_not_applicable(tmp_path):
    path = user_rewards(tmp_path)
    functions, names, _ = load_rewards([f"{path}:ends_with_answer"], None, "", 8, "cpu", torch.float32)
    completions = [[{"role": "assistant", "content": "it is 7"}], [{"role": "assistant", "content": "8 !"}]]
    table, problem = score(functions, names, [[], []], completions, [[1], [1]], {"answer": ["7", "8"]}, [4, 9])
    assert problem is None and names == ["ends_with_answer"]
    assert table[0, 0] == 1.0 and torch.isnan(table[1, 0])


@pytest.mark.parametrize(
    "name,said",
    [
        ("raises", r"reward function raises raised on a batch of rows \[4, 9\]: KeyError: 'score'"),
        ("one_short", "reward function one_short returned 1 values for 2 completions"),
        ("not_finite", r"reward function not_finite returned nan for row 9 \(completion 'b'\)"),
        ("no_kwargs", r"unexpected keyword argument .* \(a reward function takes \*\*kwargs, as TRL's do"),
        ("async_no_kwargs", r"unexpected keyword argument .* \(a reward function takes \*\*kwargs, as TRL's do"),
    ],
)
def test_a_reward_that_fails_is_one_line_naming_it_and_the_row(tmp_path, name, said):
    functions, names, _ = load_rewards([f"{user_rewards(tmp_path)}:{name}"], None, "", 8, "cpu", torch.float32)
    passed = {"trainer_state": None, "log_metric": print, "log_extra": print}  # as Rewards passes them
    _, problem = score(functions, names, ["p", "p"], ["a", "b"], [[1], [2]], passed, [4, 9])
    assert problem is not None and "\n" not in problem
    assert __import__("re").search(said, problem), problem


def test_rewards_that_cannot_load_are_one_line(tmp_path):
    """Each refused in one line; a model folder that holds no reward model says what it holds, from its config,
    before anything loads (no load report)."""
    from transformers import AutoConfig

    causal = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json")
    causal.save_pretrained(tmp_path / "causal_lm")
    labels = AutoConfig.from_pretrained(REPO / "recipes/configs/tiny_llama.json", num_labels=2)
    labels.architectures = ["LlamaForSequenceClassification"]
    labels.save_pretrained(tmp_path / "labels")
    for spec, said in [
        (f"{tmp_path}/causal_lm", r"causal_lm holds LlamaForCausalLM, not a reward model .* trains one from it"),
        (f"{tmp_path}/labels", "is a sequence classifier with 2 outputs; a reward model has one"),
        (f"{tmp_path}/nothing.py:f", "cannot import 'f'"),
        ("json:no_such_function", "cannot import 'no_such_function' from json"),
        ("sparkle", "not a built-in"),
        (str(tmp_path), "not a sequence-classification model folder"),
    ]:
        with pytest.raises(UsageError, match=said):
            load_rewards([spec], None, "", 8, "cpu", torch.float32)
    with pytest.raises(UsageError, match="--reward_weights has 2 values for 1 --reward_funcs"):
        load_rewards(["accuracy"], [1.0, 2.0], "", 8, "cpu", torch.float32)


TRL_KWARGS = """
import asyncio
import json

seen = {}

def records(prompts, completions, completion_ids, **kwargs):
    seen["kinds"] = {name: type(value).__name__ for name, value in kwargs.items()}
    seen["index"], seen["completion_ids"] = kwargs["index"], completion_ids
    json.dumps(kwargs["answer"] + ["one more"])  # lists, as TRL passes them: JSON and + work
    return [1.0] * len(completions)

def paced(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("paced/step", trainer_state.global_step)
    log_extra("pace", [trainer_state.max_steps] * len(completions))
    return [None if a == "none" else trainer_state.global_step / trainer_state.max_steps for a in answer]

async def slow(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [0.5] * len(completions)
"""


def test_reward_functions_get_what_trl_passes_and_async_ones_are_awaited(tmp_path, prompts):
    """Every column but prompt, completion and completion_ids, as a list (`index` and a `completion_ids` column of
    the data too, which collided or never arrived), plus completion_ids, trainer_state, log_metric and log_extra;
    an `async def` awaited; a completion every function returned None for has no reward (NaN)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from common.objectives.rewards import Rewards, trainer_state
    from common.objectives.rollout import PROMPT_IDS

    (tmp_path / "trl_kwargs.py").write_text(TRL_KWARGS)
    specs = [f"{tmp_path}/trl_kwargs.py:{name}" for name in ("records", "paced", "slow")]
    functions, names, weights = load_rewards(specs, [1.0, 1.0, 1.0], "", 8, "cpu", torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(prompts / "tokenizer")
    data = Dataset.from_dict(
        {
            "prompt": ["q0", "q1"],
            "answer": ["7", "9"],
            "index": [70, 90],
            "completion_ids": [[5], [6]],
            "completion": ["x", "y"],
            PROMPT_IDS: [[1], [2]],
        }
    )
    ids = tokenizer(["7", "9"], add_special_tokens=False)["input_ids"]
    rows = [{"row": 1, "completion_ids": ids[1]}, {"row": 0, "completion_ids": ids[0]}]
    rewards = Rewards(functions, names, weights, tokenizer)
    reward, table = rewards(rows, data, trainer_state(5, 20, 10))
    seen = functions[0].__globals__["seen"]
    assert seen["kinds"] == {
        "answer": "list",
        "index": "list",
        "trainer_state": "TrainerState",
        "log_metric": "function",
        "log_extra": "function",
    }, seen["kinds"]
    assert seen["index"] == [90, 70] and seen["completion_ids"] == [ids[1], ids[0]]
    assert table.tolist() == [[1.0, 0.25, 0.5], [1.0, 0.25, 0.5]] and reward.tolist() == [1.75, 1.75]
    assert rewards.logged == {"paced/step": 5.0} and rewards.extra == {"pace": [20, 20]}

    only_paced = Rewards(functions[1:2], names[1:2], [1.0], tokenizer)
    unanswered = data.map(lambda row, i: {"answer": "none" if i == 0 else row["answer"]}, with_indices=True)
    reward, _ = only_paced([rows[1], rows[0]], unanswered, trainer_state(5, 20, 10))
    assert math.isnan(reward[0]) and reward[1] == 0.25  # nothing scored it: no reward (once 0)


def test_reward_std_is_the_batchs_and_each_function_has_its_std(prompts):
    """TRL >= 0.27: reward_std is the std of every reward of the batch, not the mean of the groups' stds."""
    from transformers import AutoTokenizer

    from common.objectives.rewards import Rewards

    tokenizer = AutoTokenizer.from_pretrained(prompts / "tokenizer")
    rewards = Rewards([None, None], ["a", "b"], [1.0, 1.0], tokenizer)
    table = torch.tensor([[1.0, 0.0], [0.0, math.nan], [0.0, 0.0], [0.0, 0.0], [2.0, 0.0], [2.0, 1.0]] * 1)
    reward = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 3.0])
    values = rewards.values(reward, table)
    assert float(values["reward_std"]) == pytest.approx(
        float(reward.std())
    )  # 1.26; groups of 3: the mean of their stds 1.05
    assert float(values["rewards/a/std"]) == pytest.approx(float(table[:, 0].std()))
    assert float(values["rewards/b/std"]) == pytest.approx(float(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]).std()))
    assert values["rewards/b/mean"].tolist() == [pytest.approx(0.2)]  # the rollout's mean over the scored
    rewards.logged = {"reward": 1.0}  # a function's log_metric naming the recipe's own figure
    with pytest.raises(UsageError, match=r"log_metric\('reward', ...\) names a figure the recipe logs itself"):
        rewards.values(reward, table)


def test_a_module_in_the_working_folder_is_found_as_trls_cli_finds_it(tmp_path, monkeypatch):
    """`module:function` and TRL's dotted `module.function`, the module in the folder the run starts in (under the
    launcher sys.path[0] is recipes/, not that folder)."""
    import sys

    (tmp_path / "word_rewards_here.py").write_text(
        "def words(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(REPO / "recipes")] + [p for p in sys.path if p not in ("", str(tmp_path))])
    for spec in ("word_rewards_here:words", "word_rewards_here.words"):
        functions, names, _ = load_rewards([spec], None, "", 8, "cpu", torch.float32)
        assert names == ["words"] and functions[0](completions=["a", "b"]) == [1.0, 1.0]
    with pytest.raises(UsageError, match="cannot import 'nothing' from word_rewards_here"):
        load_rewards(["word_rewards_here.nothing"], None, "", 8, "cpu", torch.float32)


def test_trls_boolean_scale_rewards_are_group_and_none():
    from conftest import load_script

    from common.options.parsing import parse_args

    module = load_script("recipes/grpo.py")
    for spelled, meant in (("true", "group"), ("false", "none"), ("batch", "batch")):
        parsed = parse_args((module.GRPOArguments,), ["--scale_rewards", spelled])
        assert parsed[0].scale_rewards == meant


# ---- rollouts --------------------------------------------------------------------------------------------------
def test_a_draw_depends_on_its_own_logits_and_uniform_only():
    """The inverse-CDF pick of a row is the same alone or beside other rows, and top_p keeps only the smallest
    set of tokens reaching it; a draw within 1e-4 of a CDF boundary is counted as a near tie."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    uniforms = torch.tensor([[0.49], [0.95]], dtype=torch.float64)

    def pick(rows, u, top_p=1.0):
        sampler = InverseCdfSampler(u, 0, 1.0, top_p, [99])
        scores = sampler(torch.zeros((rows.shape[0], 0), dtype=torch.long), rows)
        return scores.argmax(-1).tolist(), sampler.near_ties.tolist()

    assert pick(logits, uniforms)[0] == [0, 2]
    assert pick(logits[1:], uniforms[1:])[0] == [2]  # alone: the same token
    assert pick(logits[:1], torch.tensor([[0.55]], dtype=torch.float64))[0] == [1]
    assert pick(logits[:1], torch.tensor([[0.55]], dtype=torch.float64), top_p=0.5)[0] == [0]  # 0.3 left out
    assert pick(logits[:1], torch.tensor([[0.50001]], dtype=torch.float64))[1] == [1]  # near the 0.5 boundary


def test_the_rollout_stages_split_the_layers_with_the_embeddings_and_head_counted_as_layers():
    from common.objectives.rollout_stages import stage_bounds

    assert stage_bounds(30, 2) == [(0, 15), (15, 30)]  # SmolLM2-135M: 32 units, the embeddings and 15 layers each
    assert stage_bounds(2, 2) == [(0, 1), (1, 2)]
    assert stage_bounds(6, 4) == [(0, 1), (1, 3), (3, 5), (5, 6)]  # 8 units, 2 each
    assert [end - start for start, end in stage_bounds(31, 3)] == [10, 11, 10]  # 33 units, 11 each


def test_the_stages_are_refused_where_the_ring_cannot_run():
    """One process, processes sharing a batch, layers fewer than processes, models whose forward does more than
    embeddings -> layers -> norm -> head (Gemma2's soft-capping), sliding-window attention: each named."""
    from types import SimpleNamespace

    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    from common.objectives.rollout import stages_impossible

    def why(config, processes=2, tp=1):
        accelerator = SimpleNamespace(num_processes=processes, parallelism_config=SimpleNamespace(tp_size=tp))
        return stages_impossible(accelerator, SimpleNamespace(config=config))

    llama = LlamaConfig(num_hidden_layers=2)
    assert why(llama) is None and why(Qwen2Config(num_hidden_layers=2)) is None
    assert "one process" in why(llama, processes=1)
    assert "shares a batch" in why(llama, processes=2, tp=2)
    assert "2 decoder layers cannot be cut into 4 stages" in why(llama, processes=4)
    assert "gemma2 models are not cut into stages" in why(Gemma2Config(num_hidden_layers=2))
    assert "sliding-window" in why(MistralConfig(num_hidden_layers=2, sliding_window=4096))


def test_a_rollout_saved_on_two_ranks_is_taken_up_by_one(monkeypatch):
    class Ranks:
        num_processes, process_index, parallelism_config = 2, 0, None

    rows = [{"row": r, "prompt_ids": [1, 2], "completion_ids": [3] * (r + 1), "truncated": False} for r in range(4)]
    shares = [
        {"rows": rows[:2], "advantages": [0.5, -0.5], "old_log_probs": [[-1.0], [-1.0, -2.0]]},
        {"rows": rows[2:], "advantages": [0.25, -0.25], "old_log_probs": [[-1.0] * 3, [-2.0] * 4]},
    ]
    state = {"index": 3, "iteration": 1, "shares": shares}
    one = Rollout.from_state(state, type("One", (), {"num_processes": 1, "process_index": 0})())
    assert [r["row"] for r in one.rows] == [0, 1, 2, 3] and one.advantages.tolist() == [0.5, -0.5, 0.25, -0.25]
    second = Rollout.from_state(state, type("Second", (Ranks,), {"process_index": 1})())
    assert [r["row"] for r in second.rows] == [2, 3]
    batch = next(second.micro_batches(2, 0, False, "cpu"))
    assert batch["old_log_probs"][1, 1:5].tolist() == [-2.0] * 4 and batch["mask"].sum().item() == 7


# ---- runs ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """22 arithmetic prompts (conversations, the tiny word tokenizer's chat template) and 8 held out: 4 prompts
    a step leave 2 over at each epoch's end."""
    from common.data.synthetic import write_prompt_data

    folder = tmp_path_factory.mktemp("prompts")
    write_prompt_data(str(folder), train=22, validation=8)
    (folder / "counted.py").write_text(COUNTED.format(calls=folder / "calls.txt"))
    return folder


# a user's reward that notes each call's rank and completions (shorter is better, as the built-in `length`)
COUNTED = """
import os


def counted(completions, completion_ids, **kwargs):
    with open("{calls}", "a") as handle:
        handle.write(f"{{os.environ.get('RANK')}} {{len(completions)}}\\n")
    return [-len(ids) / 10 for ids in completion_ids]
"""


def grpo_args(data: Path, out: Path, **overrides) -> list[str]:
    values = {
        "model_config": REPO / "recipes/configs/tiny_llama.json",
        "tokenizer_name_or_path": data / "tokenizer",
        "train_file": data / "train.jsonl",
        "validation_file": data / "validation.jsonl",
        "block_size": 24,
        "max_completion_length": 6,
        "num_generations": 4,
        "reward_funcs": "format",
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "per_device_eval_batch_size": 8,
        "num_train_epochs": 2,
        "num_iterations": 2,
        "learning_rate": 0.003,
        "logging_steps": 1,
        "save_steps": 1,
        "output_dir": out,
        "report_to": "none",
        "seed": 7,
        **overrides,
    }
    argv = flags(**{k: v for k, v in values.items() if v is not True and v is not None})
    return argv + [f"--{k}" for k, v in values.items() if v is True] + ["--log_completions", "--eval_on_start"]


# the objective each config's run checks, with the one-process run it is compared with
OBJECTIVES = {
    "zero3.yaml": {"loss_type": "dapo", "mask_truncated_completions": True},
    "fsdp.yaml": {"loss_type": "grpo", "beta": 0.04, "scale_rewards": "batch"},
    "ddp.yaml": {"loss_type": "dr_grpo"},
    "zero2.yaml": {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.02},  # GSPO, capped
    "zero3_offload.yaml": {  # RLOO (TRL's beta) on a reward every completion varies (its length's), at a rate that
        # keeps most whole completions' ratios inside the clip: at 3e-3 a rollout's second pass clipped 81-88% of them
        # and the rest had no advantage (gradient norm 3e-8, rounding), which Adam made 9e-5 weight gaps
        "advantage_estimator": "rloo",
        "beta": 0.05,
        "normalize_advantages": True,
        "reward_funcs": "length",
        "learning_rate": 0.0003,
    },
    "tp.yaml": {"loss_type": "dapo"},
    # GSPO with the reference: a whole completion's log-ratio and length summed over the pair's slices (with its
    # gradient), the reference scoring Ulysses' slices in train mode (DeepSpeed exchanges heads in train mode only)
    # (completions up to 12 tokens after prompts of 8: the halves of a row cut them)
    # (and a user's reward, which the pair's first rank alone calls: common.objectives.rewards.Rewards)
    "zero3_ulysses.yaml": {
        "loss_type": "grpo",
        "importance_sampling_level": "sequence",
        "beta": 0.04,
        "max_completion_length": 12,
        "reward_funcs": "counted",
    },
    # the ring: bnpo's micro-batch token count and the reference's attention as the policy's (prepare's hooks)
    "fsdp_cp.yaml": {"loss_type": "bnpo", "beta": 0.04},
}


# a second architecture beside tiny_llama: Qwen3's q/k norms, grouped-query attention and tied embeddings
MODELS = {"qwen3": REPO / "recipes/configs/tiny_qwen3.json"}


def run_grpo(key, prompts, tmp_path_factory):
    config, extra = key[0], dict(key[1])
    if extra.get("reward_funcs") == "counted":
        extra["reward_funcs"] = f"{prompts / 'counted.py'}:counted"
    if "model" in extra:
        extra["model_config"] = MODELS[extra.pop("model")]
    out = tmp_path_factory.mktemp("grpo") / "run"
    if config.startswith("one process"):  # in this process (no launch): one rank, fp32, the global batch of 2
        batch = 4 if config.endswith("tp.yaml") else 8  # tp.yaml's 2 processes are one data-parallel rank
        with pytest.MonkeyPatch.context() as patch:
            run_in_process(
                "recipes/grpo.py", grpo_args(prompts, out, per_device_train_batch_size=batch, **extra), patch
            )
    else:  # a pair that splits its rows is one data-parallel rank: it trains one process's 8 completions a step
        batch = {"per_device_train_batch_size": 8} if config in SPLIT_ROWS else {}
        launch(config, "grpo.py", grpo_args(prompts, out, **batch, **extra), num_processes=2, launcher_args=FP32)
    return out


@pytest.fixture(scope="module")
def runs(prompts, tmp_path_factory):
    return LaunchedOnce(lambda key: run_grpo(key, prompts, tmp_path_factory))


def completions(out, split: str | None = "train") -> list[dict]:
    """completions.jsonl's entries of `split` (train: the rollouts'; eval: the held-out evaluations'; None: all)."""
    entries = [json.loads(line) for line in (Path(out) / "completions.jsonl").read_text().splitlines()]
    return [entry for entry in entries if split is None or entry["split"] == split]


CONFIGS = tiered(
    [("zero3.yaml", {}), ("fsdp.yaml", {}), ("ddp.yaml", {}), ("zero2.yaml", {}), ("zero3_offload.yaml", {}),
     ("tp.yaml", {}), ("ddp.yaml", {"use_peft": True}), ("zero3.yaml", {"use_peft": True}),
     ("fsdp.yaml", {"rollout_weights": "stages"}), ("zero3.yaml", {"use_peft": True, "rollout_weights": "stages"}),
     ("fsdp.yaml", {"rollout_weights": "stages", "model": "qwen3"}), ("zero3.yaml", {"model": "qwen3"}),
     ("zero3_ulysses.yaml", {}), ("fsdp_cp.yaml", {}), ("zero3_ulysses.yaml", {"model": "qwen3"})],
    # make test: ZeRO-3's gathered copy under zero3_ulysses.yaml (its rows split too), FSDP2's under fsdp_cp.yaml,
    # the stages on Qwen3; zero3.yaml's own in make test-all
    [("fsdp.yaml", {"rollout_weights": "stages", "model": "qwen3"}), ("zero3_ulysses.yaml", {}), ("fsdp_cp.yaml", {})],
)  # fmt: skip
SPLIT_ROWS = ("zero3_ulysses.yaml", "fsdp_cp.yaml")  # a pair of ranks, one data-parallel rank: 8 completions each


@pytest.mark.slow
@pytest.mark.parametrize("config,extra", CONFIGS)
def test_each_config_samples_the_same_completions_and_trains_as_one_process(config, extra, runs, prompts):
    """fp32, 2 processes x 4 completions x accumulation 2 (4 prompts a step, G = 4; tp.yaml's pair 2), 2 epochs
    of 22 prompts (2 left over each), --num_iterations 2: every completion of every rollout is the one process's, token for
    token (a difference is allowed only at a draw counted as a near tie), each step's loss within 1e-5 and the
    final weights within 1e-5; the weights sampled from are gathered once per rollout where they are sharded: a
    whole copy, or with --rollout_weights stages a slice of the layers per process, generating as a ring. Llama,
    and Qwen3 (tied embeddings: the ring's first and last process each hold them). Under zero3_ulysses.yaml and
    fsdp_cp.yaml the pair samples the same completions (one data-parallel rank, given the one process's 8 a step)
    and each process scores a slice of every row (common.parallel.sequence_parallel.split_rows): after prompts of 8 tokens,
    Ulysses' halves of rows up to 20 tokens and the ring's 4 chunks of rows up to 14 cut the completions between the
    two processes."""
    peft = {"use_peft": True, "lora_target_modules": "all-linear"} if extra.get("use_peft") else {}
    model = {"model": extra["model"]} if "model" in extra else {}
    key = tuple(sorted({**OBJECTIVES[config], **peft, **model}.items()))
    stages = extra.get("rollout_weights") == "stages"
    out = runs[(config, tuple(sorted({**dict(key), "rollout_weights": "stages"}.items())) if stages else key)]
    single = runs[("one process as tp.yaml" if config == "tp.yaml" else "one process", key)]
    record = read_run(out)
    assert record["world_size"] == 2 and record["participating_processes"] == 2
    assert record["rows_split_over"] == (2 if config in SPLIT_ROWS else 1)
    prompts_per_step = 2 if config == "tp.yaml" else 4  # a tensor-parallel pair samples one rank's prompts
    rollouts = 2 * (22 // prompts_per_step)  # 2 epochs, the remainder left over in each
    assert record["max_steps"] == 2 * rollouts  # 2 iterations a rollout
    sharded = config in ("zero3.yaml", "fsdp.yaml", "zero3_offload.yaml", "tp.yaml", *SPLIT_ROWS)
    how = "a slice of the layers" if stages else "a whole copy" if sharded else "the policy's own"
    assert record["rollout"]["weights"].startswith(how), record["rollout"]
    from common.planning import memory as estimate  # make estimate-memory --grpo_generations counts the copy

    strategy = estimate.read_strategy(str(REPO / "accelerate_configs" / config), 2, "no")
    whole = estimate.rollout_bytes(record["total_parameters"], strategy, 4)
    held = record["rollout"]["copy_bytes_per_rank"]  # the stages: the larger slice (embeddings or head, a layer)
    assert 0 < held < whole if stages else held == whole
    assert (" fit in the " in record["rollout"]["chosen"]) == (sharded and not stages), record["rollout"]
    assert not stages or (
        record["rollout"]["layers_per_rank"] == ["0-0", "1-1"] and max(record["rollout"]["bytes_per_rank"]) == held
    )
    if OBJECTIVES[config].get("reward_funcs") == "counted":  # the pair's rewards scored once, by its first rank
        ranks = {line.split()[0] for line in (prompts / "calls.txt").read_text().splitlines()}
        assert ranks == {"None", "0"}, ranks  # None: the one process, run in this process
    ours, theirs = completions(out), completions(single)
    assert [(c["rollout"], c["row"]) for c in ours] == [(c["rollout"], c["row"]) for c in theirs]
    assert len({c["row"] for c in ours if c["rollout"] == 0}) == prompts_per_step
    assert len(ours) == rollouts * prompts_per_step * 4
    differing = [(a, b) for a, b in zip(ours, theirs) if a["completion_ids"] != b["completion_ids"]]
    near = sum(a["near_ties"] + b["near_ties"] > 0 for a, b in zip(ours, theirs))
    print(f"{config} {extra}: {len(differing)} of {len(ours)} completions differ; {near} had a near tie")
    assert all(a["near_ties"] or b["near_ties"] for a, b in differing)
    assert not [a for a, _ in differing if a["rollout"] == 0]  # equal weights: equal completions
    rows, one = read_metrics(out)[0], read_metrics(single)[0]
    assert [r["step"] for r in rows] == list(range(1, 2 * rollouts + 1)) == [r["step"] for r in one]
    # relative to the step's loss, or 1e-2 where the loss nearly cancels (its terms, -ratio x advantage, are ~0.1-1:
    # fp32's rounding of a sum of them is ~5e-8, which a 1e-3 floor made 2.9e-5 at step 18 of fsdp's stages on an
    # AVX2 host, before this change too, with the final weights 2e-7 apart)
    gaps = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-2) for a, b in zip(rows, one)]
    weight_gap = max_weight_difference(out / "final", single / "final")
    print(f"{config} {extra}: loss gap {max(gaps):.2e} (relative), final weights {weight_gap:.2e}")
    assert max(gaps) < FP32_TOLERANCE and weight_gap < FP32_TOLERANCE
    assert any(r["loss"] != 0 for r in rows)  # advantages were not all zero: the test could fail
    reward = OBJECTIVES[config].get("reward_funcs", "format")
    assert {"reward", "reward_std", f"rewards/{reward}/mean", "completions/mean_length", "completions/clipped_ratio",
            "frac_reward_zero_std", "clip_ratio/region_mean", "entropy", f"rewards/{reward}/std",
            "completions/min_length", "completions/max_length", "completions/mean_terminated_length",
            "completions/min_terminated_length", "completions/max_terminated_length", "clip_ratio/low_min",
            "clip_ratio/high_max", "num_tokens"} <= set(rows[0])  # fmt: skip
    assert ("kl" in rows[0]) == bool(OBJECTIVES[config].get("beta"))
    # TRL's figures of the global batch, over every process: the one process's for rollout 0's equal completions
    for name in ("reward_std", f"rewards/{reward}/std", "completions/min_length", "completions/max_length",
                 "completions/mean_terminated_length", "frac_reward_zero_std", "num_tokens"):  # fmt: skip
        assert rows[0][name] == pytest.approx(one[0][name], abs=1e-6), name
    assert rows[0]["completions/min_length"] <= rows[0]["completions/mean_length"] <= rows[0]["completions/max_length"]
    assert [r["num_tokens"] for r in rows] == sorted(r["num_tokens"] for r in rows) and rows[-1]["num_tokens"] > 0


@pytest.mark.slow
def test_gspo_and_delta_reach_the_loss_of_a_run(prompts, tmp_path):
    """One rollout, two passes (--num_iterations 2), in one process, as GRPO, GSPO and GRPO with --delta 1: the
    first pass's loss is the same for the three (every ratio is 1), the second's differs (the variants' ratios):
    the options reach the objective (the formulas are checked above; zero2.yaml's run against one process in make
    test-all)."""
    losses = {}
    for name, extra in {
        "grpo": {},
        "gspo": {"importance_sampling_level": "sequence"},
        "delta": {"delta": 1.0},
    }.items():
        out = tmp_path / name
        with pytest.MonkeyPatch.context() as patch:
            run_in_process(
                "recipes/grpo.py",
                grpo_args(prompts, out, max_steps=2, save_steps=0, loss_type="grpo", reward_funcs="length", **extra),
                patch,
            )
        losses[name] = [row["loss"] for row in read_metrics(out)[0]]
    print(losses)
    first, second = zip(*losses.values())
    assert max(first) - min(first) < 1e-6 and len({round(loss, 6) for loss in second}) == 3, losses


@pytest.mark.slow
def test_rloo_in_a_run_takes_trls_leave_one_out_advantages_and_kl_penalty(runs):
    """--advantage_estimator rloo --beta 0.05 --normalize_advantages in one process, two rollouts (zero3_offload.yaml's
    parity run is make test-all's): the first rollout's advantages, where the policy is still the reference (kl 0), are the
    leave-one-out advantages of its logged rewards normalised over the batch; later rollouts' carry the KL penalty
    (kl logged with each rollout, and the advantages no longer those of the rewards alone)."""
    from common.objectives.grpo import nanstd

    out = runs[("one process", tuple(sorted({**OBJECTIVES["zero3_offload.yaml"], "max_steps": 4}.items())))]
    entries, rows = completions(out), read_metrics(out)[0]

    def reward_only(rollout):  # the normalised leave-one-out advantages of the rollout's rewards, no penalty
        rewards = torch.tensor([e["reward"] for e in entries if e["rollout"] == rollout])
        advantages, _ = leave_one_out_advantages(rewards, 4)
        return ((advantages - advantages.nanmean()) / (nanstd(advantages) + 1e-4)).nan_to_num(0.0).tolist()

    logged = [[e["advantage"] for e in entries if e["rollout"] == rollout] for rollout in (0, 1)]
    assert logged[0] == pytest.approx(reward_only(0), abs=1e-5) and any(logged[0])
    assert rows[0]["kl"] == 0 and "kl" not in rows[1]  # a rollout's figure: rollout 1 is sampled at step 3
    assert rows[2]["kl"] != 0 and logged[1] != pytest.approx(reward_only(1), abs=1e-5)
    assert read_run(out)["args"]["advantage_estimator"] == "rloo"


def test_max_train_seconds_ends_grpos_loop_inside_a_rollout(runs):
    """GRPO's own loop (rollouts, --num_iterations passes over each) under a budget spent after the first step: the
    run stops there, inside rollout 0 (of 4 steps), and ends as a finished run does (the held-out evaluation, final/)."""
    out = runs[("one process", (("max_steps", 4), ("max_train_seconds", 1e-6)))]
    timing = read_run(out)["training_time"]
    assert timing["stopped_by_time_budget"] == {"step": 1} and timing["train_seconds"] > 0
    assert [row["step"] for row in read_metrics(out)[0]] == [1]
    assert {entry["rollout"] for entry in completions(out)} == {0}
    assert [entry["step"] for entry in completions(out, "eval")][-1] == 1
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_run_resumed_inside_num_iterations_repeats_the_same_steps_bit_for_bit(runs, prompts, tmp_path, monkeypatch):
    """The one-process run's checkpoint after step 3 (the second of rollout 1's two passes not yet taken): a run
    resumed there trains on the saved rollout (not a new one from the updated weights) to the same losses and the
    same final weights, bit for bit, its first row carrying TRL's num_tokens as the checkpoint counted it."""
    key = tuple(sorted(OBJECTIVES["zero3.yaml"].items()))
    done = runs[("one process", key)]
    out = tmp_path / "resumed"
    shutil.copytree(done, out)
    shutil.rmtree(out / "final")
    state = json.loads((out / "checkpoints/step_3/trainer_state.json").read_text())
    assert state["rollout"]["index"] == 1 and state["rollout"]["iteration"] == 1
    argv = grpo_args(prompts, out, per_device_train_batch_size=8, **dict(key))
    run_in_process("recipes/grpo.py", argv + ["--resume_from_checkpoint", out / "checkpoints/step_3"], monkeypatch)
    resumed = {r["step"]: r for r in read_metrics(out)[0]}
    original = {r["step"]: r for r in read_metrics(done)[0]}
    assert all(resumed[s]["loss"] == original[s]["loss"] for s in range(4, 21))
    assert resumed[4]["num_tokens"] == original[4]["num_tokens"]  # the count the checkpoint carried, on its first row
    a, b = load_weights(out / "final"), load_weights(done / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- bad input -------------------------------------------------------------------------------------------------
def refused(prompts, tmp_path, monkeypatch, said: str, **overrides):
    out = tmp_path / "run"
    with pytest.raises(UsageError, match=said) as error:
        run_in_process("recipes/grpo.py", grpo_args(prompts, out, max_steps=2, **overrides), monkeypatch)
    assert "\n" not in str(error.value)
    return out


def test_bad_input_is_one_line(prompts, tmp_path, monkeypatch):
    """No `prompt` column, completions that leave no room for a prompt in the block, a group that does not divide a
    process's completions, a reward that cannot be imported: refused before anything is written. Pipelines refused
    as for DPO (the loss scores whole completions); sequence and context parallelism taken (split_rows)."""
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"question": "what is 1 plus 1 ?", "answer": "2"}\n' * 8)
    refused(prompts, tmp_path, monkeypatch, 'prompt data needs a "prompt" column', train_file=questions,
            validation_file=questions)  # fmt: skip
    refused(prompts, tmp_path, monkeypatch, "--max_completion_length 24 leaves no room for a prompt",
            max_completion_length=24)  # fmt: skip
    refused(prompts, tmp_path, monkeypatch, "not a multiple of --num_generations 3", num_generations=3)
    out = refused(prompts, tmp_path, monkeypatch, "cannot import 'f'", reward_funcs=f"{tmp_path}/missing.py:f")
    assert not out.exists()
    refused(prompts, tmp_path, monkeypatch, "--rollout_weights stages: this config keeps whole weights",
            rollout_weights="stages")  # fmt: skip
    from common.parallel import pipeline, sequence_parallel

    module = __import__("importlib").import_module("conftest").load_script("recipes/grpo.py")
    sequence_parallel.check_arguments((module.GRPOArguments(),))  # it scores the slices of split rows itself
    with pytest.raises(UsageError, match="this recipe scores each completion's log-probabilities"):
        pipeline.check_arguments((module.GRPOArguments(),))
    # the options of one estimator given to the other (TRL's GRPOConfig and RLOOConfig each lack the other's)
    with pytest.raises(UsageError, match=r"^--loss_type, --delta: GRPO's, not in RLOO's objective \(TRL's"):
        module.GRPOArguments(advantage_estimator="rloo", loss_type="grpo", delta=1.5)
    with pytest.raises(UsageError, match=r"^--normalize_advantages: RLOO's \(TRL's RLOOConfig\); add --advantage_"):
        module.GRPOArguments(normalize_advantages=True)
    with pytest.raises(UsageError, match=r"^--reward_clip_range \[1.0, -1.0\]: two numbers, low then high"):
        module.GRPOArguments(advantage_estimator="rloo", reward_clip_range=[1.0, -1.0])


def test_a_reward_that_raises_mid_run_stops_it_in_one_line(prompts, tmp_path, monkeypatch):
    """The user's function raises at the first rollout: one line naming it and the rows; the run's folder stays."""
    out = refused(prompts, tmp_path, monkeypatch, r"reward function raises raised on a batch of rows \[\d+",
                  reward_funcs=f"{user_rewards(tmp_path)}:raises")  # fmt: skip
    assert (out / "run.json").exists()


def test_a_reward_that_scores_nothing_is_named_and_logs_none(prompts, tmp_path, monkeypatch, capsys):
    """A function returning None for every completion: a warning naming it once, and its train and eval figures
    None (nothing scored), not 0; `accuracy` without an `answer` column refused before anything is built. The
    console: the run said in one line (run.json stays in its file), the progress bar with the figures a TRL user
    watches (reward, reward_std, completions/mean_length) and, inside a step, the rollout's prompts sampled."""
    path = tmp_path / "none.py"
    path.write_text("def nothing(completions, **kwargs):\n    return [None] * len(completions)\n")
    out = tmp_path / "run"
    argv = grpo_args(prompts, out, max_steps=2, save_steps=0, reward_funcs=None)
    run_in_process("recipes/grpo.py", argv + ["--reward_funcs", f"{path}:nothing", "format"], monkeypatch)
    said = capsys.readouterr()
    assert said.err.count("reward function nothing returned None for every completion") == 1
    assert re.search(r"^run: .* on 1 process\(es\), 1 took part .*; 2 steps; the whole record: .*run.json$",
                     said.out, re.MULTILINE) and '"versions"' not in said.out, said.out  # fmt: skip
    assert re.search(r"reward=[\d.]+, reward_std=[\d.e-]+, completions/mean_length=[\d.]+", said.err), said.err[-800:]
    assert re.search(r"now=sampled 0/2 prompts", said.err) and "now=sampled 2/2 prompts" in said.err
    # completions.jsonl read alone, as TRL's table: the prompt, the columns the functions read, each function's
    # score, the advantage; the held-out evaluations' greedy completions too, each prompt once an evaluation
    logged, data = completions(out, None), [json.loads(line) for line in (prompts / "train.jsonl").open()]
    train, held_out = [e for e in logged if e["split"] == "train"], [e for e in logged if e["split"] == "eval"]
    assert len(train) == 8 and {e["rollout"] for e in train} == {0}, logged  # 2 steps: 1 rollout (2 iterations)
    for entry in train:
        assert entry["prompt"] == data[entry["row"]]["prompt"] and isinstance(entry["prompt"], list), entry
        assert entry["columns"] == {"answer": data[entry["row"]]["answer"]}, entry
        assert entry["rewards"]["nothing"] is None and entry["rewards"]["format"] in (0.0, 1.0), entry
        assert entry["reward"] == entry["rewards"]["format"] and isinstance(entry["advantage"], float), entry
    assert [(e["step"], e["row"]) for e in held_out] == [(step, row) for step in (0, 2) for row in range(8)]
    assert all(e["rewards"]["nothing"] is None and "advantage" not in e for e in held_out), held_out
    train, evaluations = read_metrics(out)[0], [r for r in read_metrics_all(out) if "eval_reward" in r]
    rolled = [r for r in train if "reward" in r]  # a rollout's figures are on its first step's line
    assert rolled and all(r["rewards/nothing/mean"] is None and r["rewards/format/mean"] is not None for r in rolled)
    assert all(r["eval_rewards/nothing/mean"] is None for r in evaluations) and evaluations
    questions = tmp_path / "no_answer.jsonl"
    questions.write_text('{"prompt": "what is 1 plus 1 ?"}\n' * 8)
    refused(prompts, tmp_path / "again", monkeypatch, r'accuracy compares each completion with the row\'s "answer" column',
            train_file=questions, validation_file=questions, reward_funcs="accuracy")  # fmt: skip


def read_metrics_all(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_reward_model_trained_here_is_a_reward_grpo_takes(prompts, tmp_path, monkeypatch):
    """recipes/reward_model.py's final/ (30 steps on the demo's kind of pairs, in this process) as --reward_funcs:
    each completion's reward in completions.jsonl is the reward model's score of the prompt and completion
    (common.objectives.reward_model.score, as its training rendered the pairs), and its metric is on the train
    lines."""
    from common.data.synthetic import write_preference_data
    from common.objectives.reward_model import load_reward_model
    from common.objectives.reward_model import score as reward_scores

    pairs, judge = tmp_path / "pairs", tmp_path / "judge"
    write_preference_data(str(pairs), train=96, validation=8)
    run_in_process(
        "recipes/reward_model.py",
        flags(
            config=REPO / "recipes/configs/reward_model_demo.yaml",
            tokenizer_name_or_path=pairs / "tokenizer",
            train_file=pairs / "train.jsonl",
            validation_file=pairs / "validation.jsonl",
            output_dir=judge,
            max_steps=30,
            per_device_train_batch_size=8,
            eval_on_start=False,
        ),  # fmt: skip
        monkeypatch,
    )
    out = tmp_path / "grpo"
    argv = grpo_args(prompts, out, max_steps=2, save_steps=0, reward_funcs=judge / "final", num_iterations=1)
    run_in_process("recipes/grpo.py", argv, monkeypatch)
    logged = completions(out)
    model, tokenizer = load_reward_model(str(judge / "final"))
    rows = [json.loads(line) for line in (prompts / "train.jsonl").read_text().splitlines()]
    expected = reward_scores(
        model, tokenizer, [rows[c["row"]]["prompt"] for c in logged], [c["completion"] for c in logged]
    )
    assert torch.allclose(torch.tensor([c["reward"] for c in logged]), expected, atol=1e-5)
    assert expected.std() > 0  # the rewards differ between completions: the test could fail
    assert all("rewards/final/mean" in r for r in read_metrics(out)[0])


@pytest.mark.slow
def test_make_grpo_as_it_ships_learns_from_the_reward_alone(tmp_path):
    """`make grpo` (ddp.yaml: 2 processes, bf16, 8 completions x accumulation 2 each, G = 8): the tiny Llama, built
    from a config, never shown an answer, goes from about no held-out reward to answering every held-out question
    with a bare number (the `format` reward), in 150 steps."""
    out = tmp_path / "run"
    result = run(["make", "grpo", f"ARGS=--output_dir {out}", f"LAUNCH_ARGS=--main_process_port {free_port()}"])
    match = re.search(
        r"held-out reward ([\d.]+) before -> ([\d.]+) over (\d+) prompts \(format ([\d.]+)", result.stdout
    )
    assert match, result.stdout[-2000:]
    before, after, count, form = float(match[1]), float(match[2]), int(match[3]), float(match[4])
    print(f"make grpo: held-out reward {before:.3f} -> {after:.3f} (format {form:.3f}) over {count} prompts")
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == HOST_PRECISION and count == 64
    assert before < 0.2 and form >= 0.9 and after >= before + 0.7


def demo_grpo(out: Path, *args: str):
    result = run_make_warm(  # make grpo is GRPO's make target launched as the README writes it
        ["make", "demo-grpo", f"GRPO_CHAT_OUT={out}", f"LAUNCH_ARGS=--main_process_port {free_port()}", *args],
    )
    evaluations = [r for r in read_metrics_all(out) if "eval_rewards/exact_match/mean" in r]
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == HOST_PRECISION
    assert record["trainable_parameters"] < record["total_parameters"] / 10  # LoRA's adapters only
    answer = re.findall(r"^A: (.*)$", result.stdout, re.MULTILINE)
    return evaluations[0], evaluations[-1], answer


@pytest.mark.slow
def test_make_demo_grpo_runs_on_the_real_model_and_its_merged_export_answers(tmp_path):
    """make test's case of `make demo-grpo` (the whole demo is make test-all's): the same command cut to 1 step and
    8 held-out prompts (2 steps took 49 of its 83 s on a 2-core host: ~23 s a step) runs on 2 processes in bf16
    (fp32 on a CPU without bf16 instructions) with LoRA, scores the base model's answers at 0 exact match (it never
    answers with the bare number), and its merged export answers the unseen question."""
    before, after, answer = demo_grpo(tmp_path / "run", "ARGS=--max_steps 1 --eval_steps 0 --max_eval_samples 8")
    assert before["step"] == 0 and after["step"] == 1 and before["eval_prompts"] == 8
    assert before["eval_rewards/exact_match/mean"] == 0 and len(answer) == 1 and answer[0].strip(), answer


@pytest.mark.slow
@pytest.mark.exhaustive
def test_make_demo_grpo_teaches_the_real_model_the_asked_format_from_rewards_alone(tmp_path):
    """The fourth demo as a user runs it: SmolLM2-135M-Instruct with LoRA on 2 processes in ddp.yaml's bf16, told
    "Answer with the number only.", rewarded for a bare number and more for the right one, never shown an answer. On
    50 questions it never trained on, the bare-number format rises from 0 to >= 0.8 and exact match of its greedy
    answers from 0 by at least 0.25 (seen in fp32 on an AVX2 host, with the log-probs scored at the sampling
    temperature as TRL scores them: format 0 -> 1.0, exact match 0 -> 0.30 in 40 steps, 21 minutes; 0 -> 0.52 in
    bf16 before that change), and the merged export answers the unseen question with a bare number."""
    before, after, answer = demo_grpo(tmp_path / "run")
    exact = before["eval_rewards/exact_match/mean"], after["eval_rewards/exact_match/mean"]
    print(
        f"make demo-grpo: held-out exact match {exact[0]:.3f} -> {exact[1]:.3f} over {after['eval_prompts']} prompts"
    )
    assert after["eval_prompts"] == 50 and exact[0] <= 0.05 and exact[1] >= exact[0] + 0.25
    assert before["eval_rewards/format/mean"] <= 0.05 and after["eval_rewards/format/mean"] >= 0.8
    assert len(answer) == 1 and answer[0].strip().isdigit(), answer  # what is 5 plus 4 ? (seen: 10, and 9 before)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_split_rows_halve_each_ranks_activations_at_101m(prompts, tmp_path):
    """At 101M parameters (recipes/configs/llama_100m.json), fp32, prompts of about 390 tokens (the arithmetic
    questions with a long preamble) and completions up to 64: what a rank saves for backward at its first training
    micro-batch (run.json's memory account) under zero3_ulysses.yaml and fsdp_cp.yaml, each rank half of every row of
    the pair's first prompt (2 completions), against zero3.yaml's rank 0, which scores the same rows whole (the
    same first prompt, the same completions): at most 0.6 of it."""
    from transformers import AutoTokenizer

    preamble = " ".join(["1 plus 2 minus 3"] * 76)  # 380 words of the data's own vocabulary
    data = tmp_path / "long"
    shutil.copytree(prompts / "tokenizer", data / "tokenizer")
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (prompts / f"{split}.jsonl").read_text().splitlines()]
        for row in rows:
            row["prompt"] = [{"role": "user", "content": f"{preamble} {row['prompt'][0]['content']}"}]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    template = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, return_dict=True)
    assert len(template["input_ids"]) > 380
    measured, first = {}, {}
    for config in ("zero3.yaml", "zero3_ulysses.yaml", "fsdp_cp.yaml"):
        out = tmp_path / config.removesuffix(".yaml")
        argv = grpo_args(
            data, out, model_config=REPO / "recipes/configs/llama_100m.json", block_size=512,
            max_completion_length=64, num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
            per_device_eval_batch_size=2, max_eval_samples=2, num_iterations=1, max_steps=1, save_steps=0,
        )  # fmt: skip
        launch(config, "grpo.py", argv, num_processes=2, launcher_args=FP32)
        record = read_run(out)
        assert record["participating_processes"] == 2 and record["total_parameters"] >= 100_000_000
        first[config] = [c["completion_ids"] for c in completions(out)][:2]  # the first prompt's, rank 0's
        per_rank = [account["activations_mb"] for account in record["memory_per_rank"]]
        measured[config] = per_rank[0] if config == "zero3.yaml" else max(per_rank)
        print(
            f"{config}: the first prompt's completions of {[len(c) for c in first[config]]} tokens, activations "
            f"per rank {per_rank} MB"
        )
    for config in ("zero3_ulysses.yaml", "fsdp_cp.yaml"):
        assert first[config] == first["zero3.yaml"]  # the same rows
        ratio = measured[config] / measured["zero3.yaml"]
        print(f"activations per rank, {config} / zero3.yaml's rank 0: {ratio:.2f}")
        assert 0.4 < ratio <= 0.6


@pytest.mark.slow
@pytest.mark.exhaustive
def test_make_benchmark_rollouts_writes_its_page(tmp_path):
    """`make benchmark-rollouts` on the tiny model under ddp and fsdp: each config's generation speed against ddp's,
    the gather (none under ddp), the copy's bytes equal to the estimate's, and the page."""
    page = tmp_path / "rollouts.md"
    model = REPO / "recipes/configs/tiny_llama.json"
    args = f"--configs ddp.yaml fsdp.yaml --model_config {model} --steps 2 --rounds 1 --docs {page}"
    result = run(["make", "-s", "benchmark-rollouts", f"ARGS={args}"])
    text = page.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip() for row in rows] == ["`ddp.yaml`", "`fsdp.yaml`"], text
    ddp, fsdp = ([cell.strip() for cell in row.split("|")[1:-1]] for row in rows)
    assert ddp[2] == "0 (0)" and ddp[4] == "1.00" and float(ddp[5]) == 0
    copy, estimated = fsdp[2].split(" ")
    assert copy == estimated.strip("()") and int(copy) >= 0 and float(fsdp[5]) > 0
    assert "ddp.yaml" in result.stdout and "fsdp.yaml" in result.stdout


def test_a_resumed_run_keeps_the_completions_it_does_not_do_again(tmp_path):
    """completions.jsonl of a run stopped after step 3 of rollouts of 2 iterations, resumed there: rollouts 0 and 1
    (sampled at steps 0 and 2) and the evaluations of steps 0 and 2 stay, rollout 2 (sampled again at step 4), the
    evaluation of step 4 and a line cut by the crash go; a fresh run (step 0) starts the file empty."""
    from types import SimpleNamespace

    from common.objectives.rollout import COMPLETIONS, CompletionLog

    lines = [{"split": "train", "rollout": r, "row": 0} for r in (0, 1, 2)]
    lines += [{"split": "eval", "step": s, "row": 0} for s in (0, 2, 4)]
    path = tmp_path / COMPLETIONS
    path.write_text("".join(json.dumps(entry) + "\n" for entry in lines) + '{"split": "tra')
    main = SimpleNamespace(is_main_process=True)
    CompletionLog(main, str(tmp_path), None, 3, 2)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == [lines[0], lines[1], lines[3], lines[4]], kept
    CompletionLog(main, str(tmp_path), None, 0, 2)
    assert path.read_text() == ""
