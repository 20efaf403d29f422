"""Knowledge distillation, as TRL's GKDTrainer computes it: the teacher, the on-policy batches, the generalised JSD.

For a token position with student log-probabilities s and teacher log-probabilities t over the vocabulary (at
temperature 1, as TRL scores them), the loss is the generalised Jensen-Shannon divergence of GKD (Agarwal et al.,
2024), with --beta in [0, 1]:

    beta 0        KL(t || s)                                   forward KL (the teacher's mass the student misses)
    beta 1        KL(s || t)                                   reverse KL (the student's mass the teacher refuses)
    otherwise     beta KL(t || m) + (1 - beta) KL(s || m),     m = log((1 - beta) e^s + beta e^t)

summed over the completion's tokens (the labels' positions) and divided by the global batch's label tokens: the
mean over every token of the step, whatever the split over processes and accumulation steps. (TRL divides by
num_items_in_batch, which for an on-policy step is the data's answer tokens, counted before the completions are
sampled; here an on-policy step is divided by its completions' own tokens.)

A step is on-policy with probability --lmbda, decided from (seed, step) alone, so every rank and a resumed run
decide alike (TRL draws Python's `random` per micro-batch and rank): its rows keep their prompts, and each gets a
completion the student samples (--temperature, --max_new_tokens; common.objectives.rollout's sampler, seeded by
(seed, step, row), from whole weights under every config). With --seq_kd the other steps' completions are the
teacher's own samples instead of the data's (TRL's sequence-level KD).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch

from common.data.chat import encode_example
from common.launch import mesh
from common.launch.errors import UsageError
from common.models.loading import load_model, load_tokenizer
from common.objectives.reference import Reference
from common.objectives.rollout import PROMPT_IDS, Rollout, SamplingSettings, row_seed, tokenize_prompts
from common.objectives.scoring import completion_logits
from common.outputs.run_dir import STATE_FILE


def prompts_only(columns: list[str], messages_column: str) -> bool:
    """Whether the data is TRL's DistillationTrainer's: a "prompt" column (text or a conversation) and no answers
    (neither a conversations column nor a "completion" one)."""
    return messages_column not in columns and "prompt" in columns and "completion" not in columns


def tokenize_prompt_rows(
    raw, tokenizer, block_size: int, max_new_tokens: int, overlong: str, accelerator, num_proc=None
):
    """Prompt-only data's rows: each prompt's tokens (common.objectives.rollout.tokenize_prompts: a conversation
    rendered with its generation prompt, a prompt that leaves --max_new_tokens no room in --block_size dropped and
    counted) with no label (its completions are sampled) and its index as `row`. Returns the datasets and the
    dropped counts. Only --overlong drop applies (a prompt cut would no longer be the prompt asked)."""
    from datasets import DatasetDict

    if overlong != "drop":
        raise UsageError(
            f"--overlong {overlong} on prompt-only data: a prompt that leaves --max_new_tokens no room in --block_size "
            "is dropped (and counted), not cut; leave --overlong at drop, or raise --block_size"
        )
    kept, dropped = tokenize_prompts(
        raw, tokenizer, block_size, max_new_tokens, accelerator, num_proc, "--max_new_tokens"
    )

    def as_row(ids, index):
        return {"input_ids": ids, "labels": [-100] * len(ids), "attention_mask": [1] * len(ids), "row": index}

    rows = DatasetDict(
        {
            split: dataset.map(
                as_row, input_columns=PROMPT_IDS, with_indices=True, remove_columns=dataset.column_names
            )
            for split, dataset in kept.items()
        }
    )
    return rows, dropped


def check_resumed_data(checkpoint: str | None, kind: str) -> None:
    """A run resumed on the other kind of data (prompts against conversations) would log one kind's evaluation
    beside the other's: refused in one line, before anything is written. A checkpoint that names no kind was
    written on conversations (the only kind then)."""
    if checkpoint is None:
        return
    with open(os.path.join(checkpoint, STATE_FILE)) as handle:
        saved = json.load(handle).get("distillation_data", "conversations")
    if saved != kind:
        raise UsageError(
            f"--resume_from_checkpoint {checkpoint}: it was trained on {saved}, this run's data is {kind}; resume "
            "with the data it was trained on, or start a new run (another --output_dir)"
        )


def turn_end_ids(tokenizer, conversational: bool) -> list[int]:
    """The token the chat template ends an assistant turn with (the last label token of a one-exchange chat it
    renders: <|im_end|>, <|eot_id|>...), for prompt-only data, which has no answers to read it from; none for text
    prompts (EOS ends them)."""
    if not conversational:
        return []
    chat = {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]}
    _, labels = encode_example(chat, tokenizer, "messages", "messages")
    return [next(label for label in reversed(labels) if label != -100)]


def check_teacher_tokenizer(tokenizer, teacher: str) -> None:
    """Teacher and student must score the same token ids: refused in one line when the teacher's tokenizer (from
    its folder) has another vocabulary."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(teacher)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"--teacher_model_name_or_path {teacher}: no tokenizer there ({type(error).__name__}); distillation "
            "needs the teacher's, to check that it is the student's"
        ) from None
    ours = tokenizer.get_vocab()
    if theirs.get_vocab() != ours:
        differing = len(set(theirs.get_vocab().items()) ^ set(ours.items()))
        raise UsageError(
            f"--teacher_model_name_or_path {teacher}: its tokenizer is not the student's ({len(theirs)} against "
            f"{len(tokenizer)} tokens, {differing} entries differ); the loss compares the two models' distributions "
            "over the same token ids: use a teacher of the student's family"
        )


def build_teacher(model_args, teacher: str, tokenizer, args) -> Reference:
    """Before `accelerator.prepare`: the teacher, frozen, in eval mode, held as DPO's reference copy is (its
    `prepare` shards it as the config shards the student)."""
    teacher_args = dataclasses.replace(
        model_args, model_name_or_path=teacher, model_config=None, adapter_name_or_path=None
    )
    model = load_model(teacher_args, load_tokenizer(teacher_args), args.seed, args)
    model.requires_grad_(False)
    return Reference("model", model.eval())


def check_vocabularies(student, teacher) -> None:
    """The two models' logits must cover the same ids (a padded embedding matrix may not)."""
    ours, theirs = student.config.get_text_config().vocab_size, teacher.config.get_text_config().vocab_size
    if ours != theirs:
        raise UsageError(
            f"the teacher's logits cover {theirs} token ids and the student's {ours}: the loss compares them id by "
            "id; use a teacher with the student's vocabulary size"
        )


def on_policy(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` (0-based) trains on the student's own completions: a uniform draw from
    (seed, step), below --lmbda. The same on every rank and in a resumed run."""
    digest = hashlib.sha256(f"on-policy/{seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < lmbda


def prompt_of(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """A tokenized chat's prompt: its tokens before its last labelled span (the last assistant turn), as TRL's
    collator cuts the conversation before its last answer; padding (left or right) left out."""
    kept = attention_mask.bool()
    input_ids, labels = input_ids[kept], labels[kept]
    labelled = (labels != -100).nonzero().flatten().tolist()
    if not labelled:
        return input_ids.tolist()
    start = labelled[-1]
    while start > 0 and labels[start - 1] != -100:
        start -= 1
    return input_ids[:start].tolist()


def completed_window(
    window: list[dict], weights, version: int, settings: SamplingSettings, seed: int, step: int, accelerator
):
    """The window's micro-batches with each row's completion replaced by one that `weights` (the student's, or the
    teacher's under --seq_kd) samples from the row's prompt, seeded by (seed, step, the row's index in the data),
    the micro-batch's prompts sampled together (common.objectives.rollout.sample_rows: one left-padded
    `generate`); labels on the completion (its stop token kept), right-padded. Every rank calls it: where the config
    shards the weights they are gathered first, unless already gathered at `version` (the student's step; the frozen
    teacher's is always 0: gathered once)."""
    weights.refresh(version)
    out = []
    for batch in window:
        prompts, uniforms, rows = [], [], batch["row"].tolist()
        for input_ids, labels, mask, row in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], rows):
            generator = torch.Generator().manual_seed(row_seed(seed, step, row))
            uniforms.append(torch.rand(settings.max_completion_length, generator=generator, dtype=torch.float64))
            prompts.append(prompt_of(input_ids.cpu(), labels.cpu(), mask.cpu()))
        sampled = [
            {"prompt_ids": prompt, "completion_ids": completion, "truncated": cut}
            for prompt, (completion, cut) in zip(
                prompts, weights.sample_each(prompts, torch.stack(uniforms), settings)
            )
        ]
        made = Rollout(step, sampled, torch.zeros(len(sampled))).batch(sampled, settings.pad_id, False)
        out.append({key: made[key].to(accelerator.device) for key in ("input_ids", "attention_mask", "labels")})
    return out


@torch.no_grad()
def held_out_divergence(model, teacher, loader, weights, settings: SamplingSettings, seed: int, version: int,
                        beta: float, accelerator) -> dict:  # fmt: skip
    """Prompt-only data's evaluation (it has no answers to score): each held-out prompt completed by the student as
    training samples it (seeded by (seed, the row): the same draws at every evaluation), and the generalised JSD to
    the teacher over the completion's tokens, averaged over every rank's tokens (each row counted once):
    eval_loss, with the completions' mean length."""
    model.eval()
    total, tokens, rows = 0.0, 0, 0
    for batch in loader:
        [completed] = completed_window([batch], weights, version, settings, seed, EVAL_DRAWS, accelerator)
        inputs = {key: completed[key] for key in ("input_ids", "attention_mask", "labels")}
        with accelerator.autocast():
            student, labels, columns = completion_logits(model, inputs)
        scored = teacher.apply(lambda scorer, b: completion_logits(scorer, b)[0], inputs)
        per_row = torch.stack(row_divergences(student, scored, labels[:, columns], beta))
        counts = (completed["labels"][:, 1:] != -100).sum(1)
        sums, counts = mesh.gather_for_metrics(accelerator, (per_row, counts))
        total, tokens, rows = total + sums.double().sum().item(), tokens + int(counts.sum()), rows + len(counts)
    model.train()
    return {"eval_loss": total / max(tokens, 1), "eval_completion_length": tokens / max(rows, 1), "eval_prompts": rows}


EVAL_DRAWS = -1  # the "step" the held-out completions are seeded by (training's steps count from 0)


def count_window(accelerator, window: list[dict], accumulation: int) -> list[dict]:
    """The window's batches, each with `num_items_in_batch`: its label tokens over every micro-batch and rank /
    (processes x accumulation), as common.training.loop.TrainBatches sets it for the data's rows."""
    tokens = torch.tensor(
        [float(sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in window))], device=accelerator.device
    )
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(tokens)
    share = float(tokens) / (accelerator.num_processes * accumulation)
    return [{**batch, "num_items_in_batch": share} for batch in window]


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Each position's generalised JSD (see the module's text) between the two rows of logits, in fp32."""
    student = student_logits.float().log_softmax(-1)
    teacher = teacher_logits.float().log_softmax(-1)
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1:
        return (student.exp() * (student - teacher)).sum(-1)
    weights = torch.tensor([1 - beta, beta], dtype=student.dtype, device=student.device).log()
    mixture = torch.logsumexp(torch.stack([student + weights[0], teacher + weights[1]]), dim=0)
    to_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
    to_student = (student.exp() * (student - mixture)).sum(-1)
    return beta * to_teacher + (1 - beta) * to_student


def row_divergences(student_logits, teacher_logits, targets, beta: float) -> list[torch.Tensor]:
    """Each row's generalised JSD summed over its scored positions (`targets` not -100: the logits at a position score
    the target there, `common.objectives.scoring.completion_logits`'s layout), row by row (one row's fp32
    log-probabilities at a time, of its scored positions only), 0 for a row without targets."""
    zero = student_logits.new_zeros((), dtype=torch.float32)
    return [
        generalized_jsd(student[kept], teacher[kept], beta).sum() if kept.any() else zero
        for student, teacher, kept in zip(student_logits, teacher_logits, targets != -100)
    ]


def distillation_loss(student_logits, teacher_logits, targets, beta: float, num_items_in_batch) -> torch.Tensor:
    """A micro-batch's share of the loss: its rows' divergences (`row_divergences`) over the global count's share
    `num_items_in_batch`."""
    total = student_logits.new_zeros((), dtype=torch.float32)
    for row in row_divergences(student_logits, teacher_logits, targets, beta):
        total = total + row
    return total / num_items_in_batch
