"""Task metrics through `evaluate`, best-checkpoint tracking and early stopping."""

from __future__ import annotations

import os

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from common.launch import mesh
from common.launch.errors import UsageError
from common.parallel import pipeline
from common.training import experts


SHIPPED_METRICS = os.path.join(os.path.dirname(__file__), "evaluate_metrics")


def load_metric(name: str):
    """A metric shipped in common/training/evaluate_metrics (offline), a local folder, or a Hub name."""
    shipped = os.path.join(SHIPPED_METRICS, name)
    try:
        import evaluate  # (it loads datasets: not before a recipe's arguments are read)

        return evaluate.load(shipped if os.path.isdir(shipped) else name)
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise UsageError(
            f"metric {name!r} is neither shipped in {SHIPPED_METRICS} nor loadable "
            f"({type(error).__name__}); use one of {sorted(os.listdir(SHIPPED_METRICS))}"
        )


class BestModelTracker:
    """Remembers the best value of one eval metric and counts evaluations without improvement.

    Its state goes into each checkpoint, so a resumed run keeps tracking the same best."""

    def __init__(self, metric: str, greater_is_better: bool = True, patience: int | None = None):
        self.metric, self.greater_is_better, self.patience = metric, greater_is_better, patience
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.evals_without_improvement = 0

    def update(self, step: int, metrics: dict) -> bool:
        """Record an evaluation; True if it is the best so far."""
        if self.metric not in metrics:
            raise UsageError(f"metric_for_best_model {self.metric!r} is not computed; choose one of {sorted(metrics)}")
        value = metrics[self.metric]
        better = self.best_value is None or (
            value > self.best_value if self.greater_is_better else value < self.best_value
        )
        if better:
            self.best_value, self.best_step, self.evals_without_improvement = value, step, 0
        else:
            self.evals_without_improvement += 1
        return better

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.evals_without_improvement >= self.patience

    def state_dict(self) -> dict:
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "evals_without_improvement": self.evals_without_improvement,
        }

    def load_state_dict(self, state: dict) -> None:
        self.best_value = state.get("best_value")
        self.best_step = state.get("best_step")
        self.evals_without_improvement = state.get("evals_without_improvement", 0)


@torch.no_grad()
def evaluate_classification(model, dataloader, accelerator, metrics: dict, f1_average: str = "macro") -> dict:
    """Loss and `evaluate` metrics over the whole eval set, every example counted once
    (`gather_for_metrics` drops the duplicates that even out the last batch)."""
    model.eval()
    loss_sum, count = 0.0, 0
    for batch in dataloader:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        losses = torch.nn.functional.cross_entropy(logits.float(), batch["labels"], reduction="none")
        predictions, references, losses = mesh.gather_for_metrics(
            accelerator, (logits.argmax(-1), batch["labels"], losses)
        )
        loss_sum += losses.double().sum().item()
        count += len(references)
        for metric in metrics.values():
            metric.add_batch(predictions=predictions.cpu(), references=references.cpu())
    model.train()
    results = {"eval_loss": loss_sum / max(count, 1), "eval_samples": count}
    for name, metric in metrics.items():
        kwargs = {"average": f1_average} if name == "f1" else {}
        results.update({f"eval_{k}": v for k, v in metric.compute(**kwargs).items()})
    return results


AUTO_MAX_NEW_TOKENS = 512  # the default --max_new_tokens at most; a longer reference answer's cut is counted


def size_max_new_tokens(requested: int | None, longest_answer: int, accelerator) -> int:
    """--max_new_tokens as given, or, unset, `longest_answer` (at most AUTO_MAX_NEW_TOKENS): the longest
    reference answer's tokens with its end of turn (`common.data.chat.answer_token_counts`), so no right answer is cut.
    A given value shorter than that is kept, with a warning."""
    if requested is None:  # capped: answers of thousands of tokens would make each evaluation a long generation
        return min(longest_answer, AUTO_MAX_NEW_TOKENS)
    if requested < longest_answer:
        accelerator.print(
            f"warning: --max_new_tokens {requested} is shorter than the longest reference answer "
            f"({longest_answer} tokens with its end of turn): longer answers will be cut and scored as "
            f"wrong; raise it to {longest_answer} or leave it unset to size it from the references"
        )
    return requested


@torch.no_grad()
def evaluate_generation(
    model,
    tokenizer,
    references: list,
    accelerator,
    max_new_tokens: int,
    stop_ids: list[int] | None = None,
    batch_size: int = 16,
    longest_answer: int | None = None,
) -> dict:
    """Exact match of greedy answers to `references`, (prompt, answer) pairs from
    `common.data.chat.generation_references`: a prompt is the turns before a conversation's last
    assistant turn (rendered with the chat template) or a prompt-completion row's text.
    Pairs are split over the data-parallel ranks (`common.launch.mesh`) and generated `batch_size` at a time,
    left-padded; every rank runs the same number of generate calls (ZeRO-3 and FSDP need all ranks in
    each forward; a tensor-parallel group's ranks generate the same pairs).
    Generation stops at `stop_ids` (default: EOS). An answer still going after `max_new_tokens`
    is cut: never a match (it was not finished), counted in eval_truncated_generations and
    named in a warning that, given `longest_answer` (see `size_max_new_tokens`), says whether
    the limit or the answer was too long."""
    model.eval()
    unwrapped = pipeline.whole_model(accelerator, model)  # pp.yaml: the stages gathered into one; else unwrapped
    stop_ids = stop_ids or [token for token in [tokenizer.eos_token_id] if token is not None]
    indexed = list(enumerate(references))
    scored = []
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # answers start at one column
    try:
        mine = mesh.data_parallel_share(accelerator, indexed)  # a tensor-parallel group generates the same
        for start in range(0, len(mine), batch_size):
            chunk = mine[start : start + batch_size]
            prompts = [
                prompt
                if isinstance(prompt, str)
                else tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                for _, (prompt, _) in chunk
            ]
            # Text prompts tokenize as plain text does (BOS and all); a rendered template has its own.
            inputs = tokenizer(
                prompts, padding=True, return_tensors="pt", add_special_tokens=isinstance(chunk[0][1][0], str)
            )
            inputs = inputs.to(accelerator.device)
            with experts.unrouted(unwrapped):  # a MoE: no router loss at each decoding step
                output = unwrapped.generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=stop_ids or None,
                    pad_token_id=tokenizer.pad_token_id,
                    synced_gpus=accelerator.num_processes > 1,
                )
            generated = output[:, inputs["input_ids"].shape[1] :]
            ended = torch.isin(generated, torch.tensor(stop_ids, device=generated.device)).any(dim=1)
            answers = tokenizer.batch_decode(generated, skip_special_tokens=True)
            scored += [
                (index, (bool(done) and text.strip() == answer.strip(), not done))
                for (index, (_, answer)), text, done in zip(chunk, answers, ended.tolist())
            ]
    finally:
        tokenizer.padding_side = padding_side
    model.train()
    seen = dict(gather_object(scored))  # keyed by index: the padding's repeated pairs count once
    cut = sum(was_cut for _, was_cut in seen.values())
    if cut and accelerator.is_main_process:  # through tqdm: the training bar stays on its own line
        tqdm.write(cut_answers_warning(cut, len(seen), max_new_tokens, longest_answer))
    return {
        "eval_exact_match": sum(match for match, _ in seen.values()) / max(len(seen), 1),
        "eval_generated": len(seen),
        "eval_truncated_generations": cut,
    }


def cut_answers_warning(cut: int, generated: int, max_new_tokens: int, longest_answer: int | None) -> str:
    """The line that says how many answers the limit cut, and whether raising it would help."""
    said = (
        f"{cut} of {generated} answers reached --max_new_tokens {max_new_tokens} before the end of the turn "
        "and were scored as wrong"
    )
    if longest_answer is not None and max_new_tokens >= longest_answer:
        return (
            f"{said}: each is longer than any reference answer ({longest_answer} tokens with its end of turn), "
            "so none was cut short of a right answer"
        )
    needed = f" to {longest_answer}, the longest reference answer with its end of turn," if longest_answer else ""
    return f"warning: {said}; raise --max_new_tokens{needed} or leave it unset to size it from the references"
