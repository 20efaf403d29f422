"""Data the project generates itself, so demos and tests never touch a hub.

`MarkovSource` is a word-level first-order Markov chain whose end-of-document
marker is one of its states. A stream of documents joined by EOS is then a
sample path of the chain, and the best possible next-token loss on it is the
chain's entropy rate, known in closed form: sum_s pi(s) * H(P[s, :]).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np


PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
SPECIAL_TOKENS = [PAD, UNK, EOS]


def make_words(count: int, seed: int) -> list[str]:
    """`count` distinct pronounceable words (consonant-vowel pairs), seeded."""
    rng = np.random.default_rng(seed)
    consonants, vowels = list("bdfgklmnprstvz"), list("aeiou")
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.integers(2, 4)
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables)))
    return sorted(words)


@dataclass
class MarkovSource:
    """Transition matrix over `words + [EOS]`; row i is P(next | current = i)."""

    words: list[str]
    transitions: np.ndarray

    @classmethod
    def random(cls, num_words=48, successors=4, end_probability=0.08, start_words=8, seed=0):
        rng = np.random.default_rng(seed)
        words = make_words(num_words, 0)  # one vocabulary for every chain: seeds share a tokenizer
        eos = num_words
        transitions = np.zeros((num_words + 1, num_words + 1))
        for state in range(num_words):
            nexts = rng.choice(num_words, size=successors, replace=False)
            transitions[state, nexts] = rng.dirichlet(np.ones(successors)) * (1 - end_probability)
            transitions[state, eos] = end_probability
        starts = rng.choice(num_words, size=start_words, replace=False)
        transitions[eos, starts] = rng.dirichlet(np.ones(start_words))
        return cls(words, transitions)

    @property
    def eos_state(self) -> int:
        return len(self.words)

    def stationary_distribution(self) -> np.ndarray:
        eigenvalues, eigenvectors = np.linalg.eig(self.transitions.T)
        vector = np.real(eigenvectors[:, np.argmin(np.abs(eigenvalues - 1))])
        return vector / vector.sum()

    def entropy_rate(self) -> float:
        """Nats per token of the stream `doc EOS doc EOS ...` (EOS counted as a token)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.where(self.transitions > 0, np.log(self.transitions), 0.0)
        row_entropy = -(self.transitions * logs).sum(axis=1)
        return float(self.stationary_distribution() @ row_entropy)

    def sample_documents(self, count: int, seed: int) -> list[str]:
        rng = np.random.default_rng(seed)
        cumulative = np.cumsum(self.transitions, axis=1)
        documents = []
        for _ in range(count):
            state, words = self.eos_state, []
            while True:
                state = int(np.searchsorted(cumulative[state], rng.random(), side="right"))
                state = min(state, self.eos_state)
                if state == self.eos_state:
                    break
                words.append(self.words[state])
            documents.append(" ".join(words))
        return documents


def build_word_tokenizer(words: list[str], chat_template: str | None = None, extra_special: tuple = ()):
    """A whitespace word-level tokenizer over `words`, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + list(extra_special) + list(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        additional_special_tokens=list(extra_special) or None,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def write_markov_corpus(out_dir: str, seed=0, train_docs=6000, validation_docs=400) -> dict:
    """Write train/validation jsonl, the tokenizer and `source.json` (with the floor)."""
    source = MarkovSource.random(seed=seed)
    write_jsonl(
        os.path.join(out_dir, "train.jsonl"), [{"text": t} for t in source.sample_documents(train_docs, seed + 1)]
    )
    write_jsonl(
        os.path.join(out_dir, "validation.jsonl"),
        [{"text": t} for t in source.sample_documents(validation_docs, seed + 2)],
    )
    build_word_tokenizer(source.words).save_pretrained(os.path.join(out_dir, "tokenizer"))
    info = {
        "seed": seed,
        "train_docs": train_docs,
        "validation_docs": validation_docs,
        "entropy_rate_nats": source.entropy_rate(),
        "entropy_rate_bits": source.entropy_rate() / math.log(2),
        "num_words": len(source.words),
    }
    with open(os.path.join(out_dir, "source.json"), "w") as handle:
        json.dump(info, handle, indent=2)
    return info


# --- Sentiment: labelled sentences for sequence classification -------------------------

POSITIVE = [
    "wonderful",
    "excellent",
    "delightful",
    "great",
    "fantastic",
    "superb",
    "lovely",
    "brilliant",
    "pleasant",
    "amazing",
    "charming",
    "enjoyable",
]
NEGATIVE = [
    "terrible",
    "awful",
    "dreadful",
    "horrible",
    "poor",
    "disappointing",
    "boring",
    "bad",
    "miserable",
    "unpleasant",
    "annoying",
    "mediocre",
]
SUBJECTS = [
    "the film",
    "this restaurant",
    "my new phone",
    "the hotel",
    "the concert",
    "that book",
    "the service",
    "our trip",
    "the coffee",
    "this game",
    "the lecture",
    "the show",
]
TRAIN_TEMPLATES = [
    "{subject} was {adjective}.",
    "i found {subject} {adjective}.",
    "honestly, {subject} is {adjective}.",
    "everyone said {subject} was {adjective}.",
]
HELD_OUT_TEMPLATES = [
    "in my opinion {subject} felt {adjective} overall.",
    "we all agreed that {subject} turned out {adjective}.",
]


def sentiment_examples(count: int, seed: int, templates: list[str]) -> list[dict]:
    """Sentences whose label ("positive"/"negative") is the sentiment of their adjective."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        label = "positive" if rng.random() < 0.5 else "negative"
        adjective = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
        text = rng.choice(templates).format(subject=rng.choice(SUBJECTS), adjective=adjective)
        rows.append({"text": text, "label": label})
    return rows


def write_sentiment_data(out_dir: str, train=1200, validation=201, seed=0) -> None:
    """Validation sentences use templates never seen in training."""
    write_jsonl(os.path.join(out_dir, "train.jsonl"), sentiment_examples(train, seed, TRAIN_TEMPLATES))
    write_jsonl(
        os.path.join(out_dir, "validation.jsonl"), sentiment_examples(validation, seed + 1, HELD_OUT_TEMPLATES)
    )


# --- Arithmetic instructions: chat data with checkable answers -------------------------

USER, ASSISTANT = "<user>", "<assistant>"
# Prompt tokens are rendered outside {% generation %}, so return_assistant_tokens_mask
# marks exactly the answer and its EOS as the tokens to learn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<user> {{ message['content'] }} "
    "{% elif message['role'] == 'assistant' %}<assistant> {% generation %}{{ message['content'] }} <eos>{% endgeneration %} "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
ARITHMETIC_WORDS = ["what", "is", "plus", "minus", "?", "count", "from", "to"] + [str(n) for n in range(19)]


def arithmetic_examples(count: int, seed: int, max_operand: int = 9, counting: bool = False) -> list[dict]:
    """'what is a plus b ?' / 'what is a minus b ?' (a >= b) with the answer as the assistant turn.
    With `counting`, a third of the questions are 'count from a to b ?' (answer: a .. b, 1 to
    12 tokens), so conversations carry very different numbers of label tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
        if counting and rng.random() < 1 / 3:
            a = int(rng.integers(0, 7))
            b = a + int(rng.integers(0, 12))
            question, answer = f"count from {a} to {b} ?", " ".join(str(n) for n in range(a, b + 1))
        elif rng.random() < 0.5:
            question, answer = f"what is {a} plus {b} ?", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"what is {a} minus {b} ?", a - b
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": str(answer)}]}
        )
    return rows


def write_arithmetic_data(out_dir: str, train=3000, validation=101, seed=0, counting=False) -> None:
    write_jsonl(os.path.join(out_dir, "train.jsonl"), arithmetic_examples(train, seed, counting=counting))
    write_jsonl(
        os.path.join(out_dir, "validation.jsonl"), arithmetic_examples(validation, seed + 1, counting=counting)
    )
    tokenizer = build_word_tokenizer(ARITHMETIC_WORDS, chat_template=CHAT_TEMPLATE, extra_special=(USER, ASSISTANT))
    tokenizer.save_pretrained(os.path.join(out_dir, "tokenizer"))


def prompt_examples(count: int, seed: int) -> list[dict]:
    """GRPO's prompts: the arithmetic questions (`arithmetic_examples`, no counting) as a one-turn conversation in
    TRL's format, with the right number in an `answer` column for the `accuracy` reward."""
    rows = []
    for row in arithmetic_examples(count, seed):
        question, answer = row["messages"]
        rows.append({"prompt": [question], "answer": answer["content"]})
    return rows


def write_prompt_data(out_dir: str, train=2000, validation=64, seed=0) -> None:
    write_jsonl(os.path.join(out_dir, "train.jsonl"), prompt_examples(train, seed))
    write_jsonl(os.path.join(out_dir, "validation.jsonl"), prompt_examples(validation, seed + 1))
    tokenizer = build_word_tokenizer(ARITHMETIC_WORDS, chat_template=CHAT_TEMPLATE, extra_special=(USER, ASSISTANT))
    tokenizer.save_pretrained(os.path.join(out_dir, "tokenizer"))


def near_miss(answer: str, rng) -> str:
    """A plausible wrong answer: a sum or difference off by one, or a count that skips or drops a number."""
    numbers = answer.split()
    if len(numbers) == 1:
        value = int(numbers[0])
        return str(value + 1 if value == 0 or (value < 18 and rng.random() < 0.5) else value - 1)
    if rng.random() < 0.5:
        return " ".join(numbers[:-1])  # stops one early
    return " ".join(numbers[:1] + numbers[2:])  # skips the second number


def preference_examples(count: int, seed: int) -> list[dict]:
    """Arithmetic and counting questions (`arithmetic_examples`) as preference pairs in TRL's conversational
    format: the right answer chosen over a near miss (`near_miss`), answers 1 to 12 tokens long."""
    rng = np.random.default_rng(seed + 1000)
    rows = []
    for row in arithmetic_examples(count, seed, counting=True):
        question, answer = row["messages"][0], row["messages"][1]["content"]
        rows.append(
            {
                "prompt": [question],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": near_miss(answer, rng)}],
            }
        )
    return rows


def write_preference_data(out_dir: str, train=2000, validation=200, seed=0) -> None:
    write_jsonl(os.path.join(out_dir, "train.jsonl"), preference_examples(train, seed))
    write_jsonl(os.path.join(out_dir, "validation.jsonl"), preference_examples(validation, seed + 1))
    tokenizer = build_word_tokenizer(ARITHMETIC_WORDS, chat_template=CHAT_TEMPLATE, extra_special=(USER, ASSISTANT))
    tokenizer.save_pretrained(os.path.join(out_dir, "tokenizer"))


# For a real chat model: the instruction in the system turn, the answer that follows it chosen.
NUMBER_ONLY = "Answer with the number only."
SENTENCES = [
    "The answer is {answer}.",
    "{a} {op} {b} is {answer}.",
    "{a} {op} {b} equals {answer}.",
    "Sure! {a} {op} {b} = {answer}.",
]


def format_pair(a: int, op: str, b: int, rng) -> dict:
    """'what is a plus b ?' under a system turn asking for the number only: the right bare number chosen over
    the right number in a sentence, which ignores the instruction."""
    answer = str(a + b if op == "plus" else a - b)
    rejected = str(rng.choice(SENTENCES)).format(a=a, op=op, b=b, answer=answer)
    return {
        "prompt": [{"role": "system", "content": NUMBER_ONLY}, {"role": "user", "content": f"what is {a} {op} {b} ?"}],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def format_questions(held_out: int, rng) -> tuple[list, list]:
    """The 155 questions (a plus b, a minus b >= 0, for a, b in 0..9) in a seeded order: (held out, the others)."""
    questions = [(a, "plus", b) for a in range(10) for b in range(10)] + [
        (a, "minus", b) for a in range(10) for b in range(a + 1)
    ]
    order = rng.permutation(len(questions))
    return [questions[i] for i in order[:held_out]], [questions[i] for i in order[held_out:]]


def write_format_prompt_data(out_dir: str, held_out=50, seed=0) -> None:
    """GRPO's prompts for a real chat model: the format demo's questions under its system turn ("Answer with the
    number only."), the right number in `answer`; the same `held_out` questions as `write_format_preference_data`
    are validation only, the other 105 train."""
    rng = np.random.default_rng(seed + 2000)
    validation, train = format_questions(held_out, rng)

    def row(a, op, b):
        prompt = [{"role": "system", "content": NUMBER_ONLY}, {"role": "user", "content": f"what is {a} {op} {b} ?"}]
        return {"prompt": prompt, "answer": str(a + b if op == "plus" else a - b)}

    write_jsonl(os.path.join(out_dir, "train.jsonl"), [row(*q) for q in train])
    write_jsonl(os.path.join(out_dir, "validation.jsonl"), [row(*q) for q in validation])


def write_format_preference_data(out_dir: str, train=2000, held_out=50, seed=0) -> None:
    """Pairs for a model that brings its own tokenizer and chat template (the real-model demo). Of the 155
    questions (a plus b, a minus b >= 0, for a, b in 0..9), `held_out` are validation only, one pair each;
    the train pairs are drawn from the others."""
    rng = np.random.default_rng(seed + 2000)
    held, seen = format_questions(held_out, rng)
    validation = [format_pair(*question, rng) for question in held]
    write_jsonl(
        os.path.join(out_dir, "train.jsonl"),
        [format_pair(*seen[i], rng) for i in rng.integers(0, len(seen), size=train)],
    )
    write_jsonl(os.path.join(out_dir, "validation.jsonl"), validation)
