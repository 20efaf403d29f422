"""GRPO's rewards: the built-ins, a user's function, a reward model; called, checked and combined.

--reward_funcs names each, --reward_weights weighs them (1 each by default); a completion's reward is the
weighted sum over the functions that score it (a function may return None for "not applicable", as TRL's).

* `accuracy`: 1 if the completion's last number equals the row's `answer` column (as numbers: "12", "12.0"
  and "the sum is 12" all match 12), else 0.
* `exact_match`: 1 if the whole completion (stripped) is the row's `answer` (stripped), else 0.
* `format`: 1 if the whole completion (stripped) matches --format_pattern (default: a bare number), else 0.
* `length`: 1 - completion tokens / --max_completion_length: the shorter the better (a tie-breaker for
  the others, with a small weight).
* `path/to/file.py:name`, `module:name` or `module.name` (TRL's dotted path; a module in the working folder
  too, as TRL's CLI finds it): a Python function, or an `async def` (awaited, several at once), with TRL's
  signature, `fn(prompts=..., completions=..., completion_ids=..., **kwargs) -> list[float | None]`: the prompts
  and completions as text (or, for conversations, lists of messages: the completion one assistant message), and
  as TRL passes them, every other column of the data as a list (one value per completion), `trainer_state`
  (transformers' TrainerState: global_step, max_steps, epoch), `log_metric(name, value)` (a figure averaged into
  the train line) and `log_extra(column, values)` (a column added to completions.jsonl).
* a folder holding a sequence classifier with one output (`recipes/reward_model.py`'s final/ or
  final_merged/, or any such Hugging Face model): its score of the prompt and completion, rendered with its own
  tokenizer (and chat template, for conversations).

A completion every function returned None for has no reward: common.objectives.grpo leaves it out of its group's
mean and std and gives it advantage 0, as TRL. A function that raises, returns another number of values, or a value
that is not a finite number (None aside) ends the run in one line naming the function and the row (every rank stops
together: `check_everywhere`); the run's checkpoints are kept.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys

import torch
from accelerate.utils import gather_object

from common.launch import mesh
from common.launch.errors import UsageError, describe
from common.launch.internals import without_zero3_init
from common.objectives.grpo import global_rows, nanstd
from common.objectives.rollout import PROMPT_IDS
from common.outputs.metrics import RESERVED


BUILT_IN = ("accuracy", "exact_match", "format", "length")
# the keys TRL passes a reward function itself, never a data column of the same name
PASSED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
NOT_PASSED = ("prompt", "completion", "completion_ids")  # the data's columns TRL leaves out
# the recipe's own figures beside the reward ones and the train line's keys, which a function's log_metric may not
# replace
RESERVED_FIGURES = ("frac_reward_zero_std", "entropy", "kl", "num_tokens", *RESERVED)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def completion_text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def accuracy_reward(completions, answer, **_) -> list[float]:
    """1 where the completion's last number equals the row's answer."""
    scores = []
    for completion, expected in zip(completions, answer):
        got, want = last_number(completion_text(completion)), last_number(str(expected))
        scores.append(float(got is not None and want is not None and math.isclose(got, want)))
    return scores


def exact_match_reward(completions, answer, **_) -> list[float]:
    """1 where the completion is the answer, nothing more."""
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


class FormatReward:
    __name__ = "format"

    def __init__(self, pattern: str):
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as error:
            raise UsageError(f"--format_pattern {pattern!r} is not a regular expression ({error})") from None

    def __call__(self, completions, **_) -> list[float]:
        return [float(self.pattern.fullmatch(completion_text(c).strip()) is not None) for c in completions]


class LengthReward:
    __name__ = "length"

    def __init__(self, max_completion_length: int):
        self.max_completion_length = max_completion_length

    def __call__(self, completion_ids, **_) -> list[float]:
        return [1.0 - len(ids) / self.max_completion_length for ids in completion_ids]


class RewardModel:
    """A sequence classifier with one output as a reward (`common.objectives.reward_model`: its score at the last token
    of the prompt and completion, rendered as its training rendered pairs), a whole copy on each rank."""

    def __init__(self, folder: str, device, dtype):
        from common.objectives.reward_model import load_reward_model

        self.__name__ = os.path.basename(os.path.normpath(folder))
        try:
            with without_zero3_init():  # a whole copy on each rank, outside the run's ZeRO-3 partitioning
                self.model, self.tokenizer = load_reward_model(folder, device, dtype)
        except UsageError as error:
            raise UsageError(f"--reward_funcs {folder}: {error}") from None
        except (OSError, ValueError) as error:
            raise UsageError(
                f"--reward_funcs {folder}: not a sequence-classification model folder ({describe(error)}); pass a "
                "reward model's final/ (make reward-model) or final_merged/"
            ) from None

    def __call__(self, prompts, completions, **_) -> list[float]:
        from common.objectives.reward_model import score as reward_scores

        return reward_scores(self.model, self.tokenizer, prompts, completions).tolist()


def import_function(spec: str):
    """`path/to/file.py:name`, `module:name` or `module.name` (TRL's dotted form), a module found in the working
    folder too (as TRL's CLI, which puts it first on the path); or a one-line UsageError."""
    where, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise FileNotFoundError(f"no file {where}")
            module_spec = importlib.util.spec_from_file_location(f"reward_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # under the launcher sys.path[0] is recipes/, not the working folder
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
        function = getattr(module, name)
    except Exception as error:  # the user's file may raise anything on import
        raise UsageError(
            f"--reward_funcs {spec}: cannot import {name!r} from {where} ({describe(error)}); give "
            "path/to/file.py:function, module:function or module.function"
        ) from None
    if not callable(function):
        raise UsageError(f"--reward_funcs {spec}: {name} is not a function")
    return function


NEEDS_ANSWER = ("accuracy", "exact_match")  # the built-ins that read an `answer` column


def load_rewards(
    specs: list[str],
    weights: list[float] | None,
    format_pattern: str,
    max_completion_length: int,
    device,
    dtype,
    columns: list[str] | None = None,
) -> tuple[list, list[str], list[float]]:
    """(functions, their names as the metrics call them, weights) for --reward_funcs / --reward_weights; `columns`:
    the training data's, checked against what the built-ins read."""
    if not specs:
        raise UsageError(
            f"--reward_funcs is empty: name at least one ({', '.join(BUILT_IN)}, file.py:function, "
            "module:function or a reward model folder)"
        )
    weights = list(weights) if weights else [1.0] * len(specs)
    if len(weights) != len(specs):
        raise UsageError(
            f"--reward_weights has {len(weights)} values for {len(specs)} --reward_funcs: give one per function"
        )
    functions, names = [], []
    for spec in specs:
        if spec in NEEDS_ANSWER and columns is not None and "answer" not in columns:
            raise UsageError(
                f'--reward_funcs {spec} compares each completion with the row\'s "answer" column, which the data '
                f"lacks (its columns: {columns}); add one, or map yours with dataset_mixture's columns"
            )
        if spec == "accuracy":
            function = accuracy_reward
        elif spec == "exact_match":
            function = exact_match_reward
        elif spec == "format":
            function = FormatReward(format_pattern)
        elif spec == "length":
            function = LengthReward(max_completion_length)
        elif os.path.isdir(spec):
            function = RewardModel(spec, device, dtype)
        elif ":" in spec or ("." in spec.strip(".") and "/" not in spec):
            function = import_function(spec)
        else:
            raise UsageError(
                f"--reward_funcs {spec}: not a built-in ({', '.join(BUILT_IN)}), a folder, file.py:function, "
                "module:function or module.function"
            )
        functions.append(function)
        name = spec if spec in BUILT_IN else getattr(function, "__name__", spec.rpartition(":")[2])
        names.append(name if name not in names else f"{name}_{len(names)}")
    return functions, names, weights


@functools.cache
def event_loop() -> asyncio.AbstractEventLoop:
    """The one event loop the async reward functions run on, kept for the run (as TRL keeps one): a client an async
    function holds from one call to the next stays bound to a live loop."""
    return asyncio.new_event_loop()


def is_async(function) -> bool:
    """Whether calling `function` (a partial's, a callable object's __call__ too) returns a coroutine, as TRL tells."""
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


def score(functions, names, prompts, completions, completion_ids, kwargs: dict, rows: list[int]):
    """(count x functions) rewards of this rank's completions, NaN where a function returned None, and the first
    problem as a line (None if none): a function that raised, returned another count or a non-finite number.
    `kwargs`: what TRL passes besides prompts, completions and completion_ids (the data's other columns as lists,
    trainer_state, log_metric, log_extra); the `async def` functions are awaited together, after the others, as
    TRL runs them. `rows`: each completion's row in the data (named in the line)."""
    table = torch.full((len(completions), len(functions)), float("nan"), dtype=torch.float64)
    inputs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    outputs, waiting = {}, {}
    for column, function in enumerate(functions):
        try:  # an async function's call makes its coroutine (a signature that does not fit raises here)
            outputs[column] = function(**inputs)
        except Exception as error:  # the user's code: any exception ends the run in one line
            outputs[column] = error
        if is_async(function) and not isinstance(outputs[column], Exception):
            waiting[column] = outputs.pop(column)
    if waiting:

        async def together():
            return await asyncio.gather(*waiting.values(), return_exceptions=True)

        outputs.update(zip(waiting, event_loop().run_until_complete(together())))
    for column, name in enumerate(names):
        values = outputs[column]
        if isinstance(values, Exception):
            hint = (
                " (a reward function takes **kwargs, as TRL's do: it is passed every column, trainer_state, "
                "log_metric and log_extra)"
                if isinstance(values, TypeError) and "unexpected keyword argument" in str(values)
                else ""
            )
            return (
                table,
                f"reward function {name} raised on a batch of rows {sorted(set(rows))[:8]}: {describe(values)}{hint}",
            )
        try:
            values = list(values)
        except TypeError:
            return table, f"reward function {name} returned {type(values).__name__}, not a list of numbers"
        if len(values) != len(completions):
            return table, (
                f"reward function {name} returned {len(values)} values for {len(completions)} completions "
                f"(rows {sorted(set(rows))[:8]}): return one per completion (None where it does not apply)"
            )
        for index, value in enumerate(values):
            if value is None:
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                return table, (
                    f"reward function {name} returned {value!r} for row {rows[index]} (completion "
                    f"{completion_text(completions[index])[:60]!r}): a reward must be a finite number or None"
                )
            table[index, column] = number
    return table, None


def check_everywhere(problem: str | None) -> None:
    """Every rank calls it after scoring: if any rank met a problem, all raise the first one's line together
    (a rank left alone in the next collective would hang)."""
    problems = [p for p in gather_object([problem]) if p]
    if problems:
        raise UsageError(problems[0] + "; the run stopped (its checkpoints are kept)")


def trainer_state(step: int, max_steps: int, steps_per_epoch: int):
    """What TRL passes a reward function as trainer_state: transformers' TrainerState at optimizer step `step`."""
    from transformers import TrainerState

    return TrainerState(
        global_step=step,
        max_steps=max_steps,
        epoch=step / max(steps_per_epoch, 1),
        num_train_epochs=math.ceil(max_steps / max(steps_per_epoch, 1)),
    )


def combine(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Each completion's reward: the weighted sum over the functions that scored it (NaN counts 0, as TRL's nansum)."""
    return (table * torch.tensor(weights, dtype=table.dtype)).nansum(dim=1)


class Rewards:
    """--reward_funcs with their weights, over completions of rows of `dataset` (the prompts' split, which
    holds each row's prompt and other columns)."""

    def __init__(self, functions, names, weights, tokenizer, accelerator=None):
        self.functions, self.names, self.weights, self.tokenizer = functions, names, weights, tokenizer
        self.accelerator, self.warned = accelerator, set()
        self.logged, self.extra = {}, {}  # the last call's log_metric figures (over every rank), log_extra columns
        self.read = ([], {})  # the last call's prompts and the data's columns the functions were passed

    def __call__(self, rows: list[dict], dataset, state=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(each completion's reward, NaN where no function scored it; the (completions x functions) table, NaN
        where a function returned None); every rank calls it together (a problem on any rank stops all of them in
        one line). `state`: the functions' trainer_state (`trainer_state`). The ranks that hold the same completions
        (a tensor-, context- or sequence-parallel group: `mesh.batch_sharers`) have them scored once, by the group's
        first rank, and share its table: a function is called once a completion (a paid judge too), and one that
        does not repeat itself cannot hand the group's ranks different advantages."""
        sharers = mesh.batch_sharers(self.accelerator) if self.accelerator is not None else 1
        first = self.accelerator.process_index // sharers * sharers if sharers > 1 else None
        data = dataset.select([row["row"] for row in rows]) if rows else dataset.select([])
        prompts = list(data["prompt"]) if rows else []
        texts = self.tokenizer.batch_decode([row["completion_ids"] for row in rows], skip_special_tokens=True)
        completions = [
            text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            for prompt, text in zip(prompts, texts)
        ]
        skipped = (*NOT_PASSED, *PASSED, PROMPT_IDS)
        kwargs = {name: list(data[name]) for name in data.column_names if name not in skipped}
        self.read = (prompts, dict(kwargs))
        pending, self.extra = {}, {}
        kwargs.update(
            trainer_state=state if state is not None else trainer_state(0, 0, 1),
            log_metric=lambda name, value: pending.setdefault(name, []).append(float(value)),
            log_extra=lambda column, values: self.extra.setdefault(column, []).extend(values),
        )
        if first is None or self.accelerator.process_index == first:
            table, problem = score(
                self.functions,
                self.names,
                prompts,
                completions,
                [row["completion_ids"] for row in rows],
                kwargs,
                [row["row"] for row in rows],
            )
        else:  # scored by the group's first rank
            table, problem = torch.full((0, len(self.functions)), math.nan, dtype=torch.float64), None
        check_everywhere(problem)
        if first is not None:  # the group's first rank's table (every rank calls it: one gather)
            table = gather_object([table])[first]
            assert table.shape[0] == len(rows), "a group's ranks must hold the same completions"
        self.logged = self.pool(pending)
        self.warn_if_none_scored(table)
        rewards = combine(table, self.weights)
        rewards[table.isnan().all(dim=1)] = math.nan  # no function scored it: no reward (left out, advantage 0)
        return rewards.float(), table.float()

    def pool(self, pending: dict) -> dict:
        """log_metric's figures: each name's values averaged over every rank's calls (TRL's mean over processes)."""
        if self.accelerator is None or self.accelerator.num_processes == 1:
            return {name: sum(values) / len(values) for name, values in pending.items()}
        names = sorted({name for share in gather_object([sorted(pending)]) for name in share})
        sums = torch.tensor(
            [[sum(pending.get(name, [])), len(pending.get(name, []))] for name in names], dtype=torch.float64
        )
        totals = self.accelerator.reduce(sums.to(self.accelerator.device), reduction="sum").cpu()
        # a tensor-, context- or sequence-parallel group's first rank alone calls the functions (`__call__`)
        return {name: float(total / count) for name, (total, count) in zip(names, totals.tolist()) if count}

    def warn_if_none_scored(self, table: torch.Tensor) -> None:
        """A function that returned None for every completion of a rollout (on this rank) is named once: it gives
        no signal (its metric is then empty, not 0)."""
        quiet = self.accelerator is not None and not self.accelerator.is_main_process
        for column, name in enumerate(self.names):
            if len(table) and table[:, column].isnan().all() and name not in self.warned and not quiet:
                self.warned.add(name)
                print(
                    f"warning: reward function {name} returned None for every completion of a rollout: it scores "
                    "nothing there (check what it reads), and the others decide the advantages",
                    file=sys.stderr,
                )

    def values(self, rewards: torch.Tensor, table: torch.Tensor) -> dict:
        """TRL's reward figures of a rollout, for `MetricsLogger.record_values`: `reward` and `rewards/<name>/mean`
        over the completions scored, `reward_std` and `rewards/<name>/std` over the global batch (every rank calls
        it: one gather), and the functions' log_metric figures. TRL >= 0.27's reward_std: the std of every reward of
        the batch (before 0.27, the mean of the groups' stds)."""
        local = torch.cat([rewards.unsqueeze(1), table], 1)
        every = global_rows(self.accelerator, local) if self.accelerator else local

        def one(value: torch.Tensor) -> torch.Tensor:  # a figure of the whole batch, as each rank records it
            return value.reshape(1) if not value.isnan() else torch.zeros(0)  # NaN (none or, for a std, 1 scored)

        # each a figure of the rollout, as TRL appends one a generation: a logging window averages the rollouts'
        values = {"reward": one(every[:, 0].nanmean()), "reward_std": one(nanstd(every[:, 0]))}
        for column, name in enumerate(self.names):
            values[f"rewards/{name}/mean"] = one(every[:, column + 1].nanmean())
            values[f"rewards/{name}/std"] = one(nanstd(every[:, column + 1]))
        taken = [name for name in self.logged if name in values or name in RESERVED_FIGURES]
        if taken:
            raise UsageError(
                f"a reward function's log_metric({taken[0]!r}, ...) names a figure the recipe logs itself; give it "
                "another name"
            )
        values.update({name: torch.tensor([value]) for name, value in self.logged.items()})
        return values


def evaluate_rewards(
    sampler, rewards: Rewards, dataset, step: int, batch_size: int, limit: int | None, state=None, log=None
) -> dict:
    """The held-out prompts' greedy completions (the first `limit`; `common.objectives.rollout.Sampler.greedy`) scored:
    eval_reward (over the completions some function scored), eval_rewards/<name>/mean, eval_completions/mean_length
    and /clipped_ratio, eval_prompts, and the functions' log_metric figures as eval_<name>. Every rank calls it;
    each prompt counts once. `state`: the functions' trainer_state; `log`: --log_completions' log, if asked."""
    rows = sampler.greedy(dataset, step, batch_size, limit)
    reward, table = rewards(rows, dataset, state)
    if log is not None:  # --log_completions (common.objectives.rollout.CompletionLog)
        log.held_out(rows, reward, table, rewards, step)
    mine = [
        (row["row"], float(value), scores.tolist(), len(row["completion_ids"]), row["truncated"])
        for row, value, scores in zip(rows, reward, table)
    ]
    seen = {entry[0]: entry[1:] for entry in gather_object(mine)}  # the padding's repeated prompts count once
    count = max(len(seen), 1)
    scored = [value for value, *_ in seen.values() if not math.isnan(value)]
    results = {
        "eval_reward": sum(scored) / len(scored) if scored else None,  # None: nothing scored
        "eval_completions/mean_length": sum(length for *_, length, _ in seen.values()) / count,
        "eval_completions/clipped_ratio": sum(cut for *_, cut in seen.values()) / count,
        "eval_prompts": len(seen),
    }
    for column, name in enumerate(rewards.names):
        scored = [scores[column] for _, scores, *_ in seen.values() if not math.isnan(scores[column])]
        results[f"eval_rewards/{name}/mean"] = sum(scored) / len(scored) if scored else None  # None: nothing scored
    results.update({f"eval_{name}": value for name, value in rewards.logged.items() if f"eval_{name}" not in results})
    return results
