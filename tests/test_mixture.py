"""--dataset_mixture (common/data/mixture.py): several sources mixed into one training set, seeded and
exact, in the alignment-handbook's format; sources of different conversation shapes mixed; the
rows of each recorded in run.json and the model card; a run resumed at the same place."""

import json
import shutil
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import HOST_PRECISION, REPO, flags, launch, losses, read_metrics, read_run

from common.launch.errors import UsageError


@pytest.fixture(scope="module")
def chat_sources(arithmetic_data, tmp_path_factory):
    """Three sources in three formats, as users have them: OpenAI-style messages with content as text
    parts (jsonl), ShareGPT turns under `conversations` (jsonl) and role/content messages under `chat`
    (parquet), with an extra column each; `row` numbers every row."""
    from datasets import Dataset

    from common.data.synthetic import arithmetic_examples, write_jsonl

    out = tmp_path_factory.mktemp("mixture")
    openai = [
        {"messages": row["messages"], "row": index, "source": "a"}
        for index, row in enumerate(arithmetic_examples(300, seed=10))
    ]
    for row in openai:
        for turn in row["messages"]:
            turn["content"] = [{"type": "text", "text": turn["content"]}]
    write_jsonl(str(out / "openai.jsonl"), openai)
    sharegpt = [
        {
            "conversations": [
                {"from": {"user": "human", "assistant": "gpt"}[turn["role"]], "value": turn["content"]}
                for turn in row["messages"]
            ],
            "row": 1000 + index,
            "id": index,
            "lang": "en",
        }
        for index, row in enumerate(arithmetic_examples(200, seed=11))
    ]
    write_jsonl(str(out / "sharegpt.jsonl"), sharegpt)
    plain = [
        {"chat": row["messages"], "row": 2000 + index, "origin": "generated"}
        for index, row in enumerate(arithmetic_examples(200, seed=12))
    ]
    Dataset.from_list(plain).to_parquet(str(out / "plain.parquet"))
    (out / "plain.json").write_text(json.dumps({row["row"]: row["chat"] for row in plain}))
    return out


def mixture(sources, row=True, **more) -> dict:
    """Half the OpenAI rows, 250 of the 200 ShareGPT ones and a quarter of the parquet ones, with the
    rows' ids (`row`) where asked."""
    row = {"row": "row"} if row else {}
    return {
        "datasets": [
            {"id": str(sources / "openai.jsonl"), "columns": {"messages": "messages", **row}, "weight": 0.5},
            {"id": str(sources / "sharegpt.jsonl"), "columns": {"conversations": "messages", **row}, "samples": 250},
            {"id": str(sources / "plain.parquet"), "columns": {"chat": "messages", **row}, "weight": 0.25},
        ],
        **more,
    }


def load(block: dict, seed: int = 42):
    from common.data.loading import load_raw_datasets
    from common.options.arguments import DataArguments

    args = DataArguments(dataset_mixture=json.dumps(block))
    return load_raw_datasets(args, seed), args.mixture.counts


def test_a_mixture_takes_each_sources_rows_exactly_and_seeded(chat_sources):
    """Half of the 300 OpenAI rows (weight 0.5), 250 rows of the 200 ShareGPT ones (every row, then
    50 again) and 50 of the 200 parquet ones (0.25): 450 rows, 40 held out (test_split_size) by a
    seeded permutation, each source's share of both counted, and held out of its distinct rows
    before any is repeated, so no held-out row is trained on. The ShareGPT turns and the text parts
    come as role/content text, so the three mix; the same seed gives the same rows, another seed
    others."""
    from common.data.chat import as_messages

    raw, counts = load(mixture(chat_sources, test_split_size=40, seed=0))
    assert (len(raw["train"]), len(raw["validation"])) == (410, 40)
    assert [(c["available"], c["rows"]) for c in counts] == [(300, 150), (200, 250), (200, 50)]
    assert all(c["train"] + c["held_out"] == c["rows"] for c in counts)
    assert sum(c["held_out"] for c in counts) == 40 and raw["train"].column_names == ["messages", "row"]

    rows = {
        json.loads(line)["row"]: as_messages(json.loads(line).get("messages") or json.loads(line)["conversations"])
        for name in ("openai", "sharegpt")
        for line in (chat_sources / f"{name}.jsonl").open()
    }
    rows.update({int(row): chat for row, chat in json.loads((chat_sources / "plain.json").read_text()).items()})
    for split in ("train", "validation"):  # each row as role/content text, whatever its source's shape
        assert all(rows[row] == messages for row, messages in zip(raw[split]["row"], raw[split]["messages"]))
    taken = Counter(list(raw["train"]["row"]) + list(raw["validation"]["row"]))
    from_openai = {row: n for row, n in taken.items() if row < 1000}
    from_sharegpt = {row: n for row, n in taken.items() if 1000 <= row < 2000}
    assert sum(row >= 2000 for row in taken) == 50 and all(n == 1 for row, n in taken.items() if row >= 2000)
    assert len(from_openai) == 150 and set(from_openai.values()) == {1}  # no row twice
    assert len(from_sharegpt) == 200 and sorted(Counter(from_sharegpt.values()).items()) == [(1, 150), (2, 50)]
    assert sum(row < 1000 for row in raw["validation"]["row"]) == counts[0]["held_out"]
    assert not set(raw["validation"]["row"]) & set(raw["train"]["row"])
    assert {row < 1000 for row in raw["validation"]["row"][:10]} == {True, False}  # the held-out rows are mixed too

    again, _ = load(mixture(chat_sources, test_split_size=40, seed=0))
    assert again["train"]["messages"] == raw["train"]["messages"]
    other, _ = load(mixture(chat_sources, test_split_size=40, seed=1))
    assert other["train"]["messages"] != raw["train"]["messages"]
    # no seed in the mixture: the run's --seed; no test_split_size: --validation_split_percentage (5%)
    by_run_seed, _ = load(mixture(chat_sources, test_split_size=40), seed=0)
    assert by_run_seed["train"]["messages"] == raw["train"]["messages"]
    by_percentage, _ = load(mixture(chat_sources))
    assert (len(by_percentage["train"]), len(by_percentage["validation"])) == (428, 22)  # round(5% of 450)


@pytest.mark.parametrize(
    "block, expected",
    [
        (
            {"datasets": [{"id": "{openai}", "weight": 0}]},
            r"source 0 \(.*openai.jsonl\): weight must be a number above 0",
        ),
        ({"datasets": [{"id": "{openai}", "weight": "half"}]}, "weight must be a number above 0"),
        ({"datasets": [{"id": "{openai}", "weight": -0.5}]}, "weight must be a number above 0"),
        ({"datasets": [{"id": "{openai}", "weight": 0.5, "samples": 10}]}, "give weight .* or samples .*, not both"),
        ({"datasets": [{"id": "{openai}", "samples": 2.5}]}, "samples must be a whole number of rows >= 1"),
        (
            {"datasets": [{"id": "{openai}", "fraction": 0.5}]},
            "unknown key\\(s\\) 'fraction'; the keys are id, config",
        ),
        ({"datasets": [{"weight": 0.5}]}, "source 0 must be a mapping with an `id`"),
        ({"datasets": [{"id": "data/none.jsonl"}]}, "no such file or folder; check the path"),
        (
            {"datasets": [{"id": "{openai}", "columns": "messages"}]},
            "columns must be a list of column names or a mapping",
        ),
        ({"datasets": [{"id": "{openai}"}], "test_split_size": 1.5}, "test_split_size must be a number of rows"),
        ({"datasets": [{"id": "{openai}"}], "shuffle": True}, "the mixture has unknown key\\(s\\) 'shuffle'"),
        (
            {"datasets": [{"id": "{openai}", "columns": {"messages": "text", "source": "text"}}]},
            "maps two columns to one",
        ),
        ({"datasets": [{"id": "{openai}", "weight": float("inf")}]}, "weight must be a number above 0"),
        ({"sources": []}, "a dataset mixture is a mapping with `datasets:`"),
    ],
)
def test_a_bad_mixture_is_one_line_before_anything_loads(chat_sources, block, expected):
    from common.options.arguments import DataArguments

    text = json.dumps(block).replace("{openai}", str(chat_sources / "openai.jsonl"))
    with pytest.raises(UsageError, match=expected) as refused:
        DataArguments(dataset_mixture=text)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            {"id": "{sharegpt}", "columns": ["messages"]},
            r"has no column\(s\) 'messages' \(its columns: \['conversations'",
        ),
        (
            {"id": "{sharegpt}"},
            r"has columns \['conversations', 'id', 'lang', 'row'\] and .*openai.jsonl \['messages', 'row', "
            r"'source'\]; map them",
        ),
        (
            {"id": "{sharegpt}", "columns": {"conversations": "messages", "lang": "row"}},
            r"column 'row' of .*sharegpt.jsonl \(Value\('string'\)\) is not of the kind of .*openai.jsonl's "
            r"\(Value\('int64'\)\); make them the same",
        ),
        # labels as text in one source and numbers in the other would be four classes, not two
        (
            {"id": "{sharegpt}", "columns": {"conversations": "messages", "id": "source"}},
            r"column 'source' of .*sharegpt.jsonl \(Value\('int64'\)\) is not of the kind of .*openai.jsonl's "
            r"\(Value\('string'\)\)",
        ),
        (
            {"id": "{sharegpt}", "split": "train_sft"},
            r"source .*sharegpt.jsonl split train_sft does not load \("
            r"ValueError: Unknown split",
        ),
        ({"id": "{empty}"}, r"source .*empty.jsonl split train does not load \(no data in it\)"),
    ],
)
def test_sources_that_do_not_fit_together_are_one_line(chat_sources, source, expected):
    (chat_sources / "empty.jsonl").write_text("")
    files = {"{sharegpt}": str(chat_sources / "sharegpt.jsonl"), "{empty}": str(chat_sources / "empty.jsonl")}
    block = {
        "datasets": [
            {"id": str(chat_sources / "openai.jsonl")},
            {key: files.get(value, value) if isinstance(value, str) else value for key, value in source.items()},
        ]
    }
    if isinstance(source.get("columns"), dict):  # the first source's columns: the same names
        block["datasets"][0]["columns"] = ["messages", list(source["columns"].values())[1]]
    with pytest.raises(UsageError, match=expected):
        load(block)


def test_a_mixture_with_what_it_replaces_is_refused(chat_sources):
    from common.options.arguments import DataArguments

    with pytest.raises(UsageError, match="give exactly one of --dataset_name, --train_file or --dataset_mixture"):
        DataArguments(dataset_mixture=json.dumps(mixture(chat_sources)), train_file=str(chat_sources / "openai.jsonl"))
    with pytest.raises(UsageError, match="--validation_file and the mixture's test_split_size both give"):
        DataArguments(
            dataset_mixture=json.dumps(mixture(chat_sources, test_split_size=10)),
            validation_file=str(chat_sources / "openai.jsonl"),
        )


@pytest.mark.slow
def test_sft_on_a_mixture_under_ddp_records_its_sources_and_resumes_at_the_same_place(
    chat_sources, arithmetic_data, tmp_path
):
    """sft.py on 2 processes (ddp.yaml, bf16 as it ships, accumulation 2) with the mixture in its
    recipe YAML, as the handbook writes it: run.json and the model card give each source's rows,
    and a run stopped at its step-3 checkpoint resumes to the same per-step losses (the mixed set
    and its order are the same in the second launch)."""
    import yaml

    recipe = yaml.safe_load((REPO / "recipes/configs/sft_demo.yaml").read_text())
    recipe.pop("train_file", None), recipe.pop("validation_file", None)
    recipe["dataset_mixture"] = mixture(chat_sources, row=False, test_split_size=40, seed=0)
    config = tmp_path / "sft_mixture.yaml"
    config.write_text(yaml.safe_dump(recipe))

    def args(out, **more):
        return flags(
            config=config,
            tokenizer_name_or_path=arithmetic_data / "tokenizer",
            output_dir=out,
            max_steps=6,
            save_steps=3,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            logging_steps=1,
            eval_steps=0,
            max_generation_samples=4,
            report_to="none",
            **more,
        )

    out = tmp_path / "run"
    launch("ddp.yaml", "sft.py", args(out))
    record = read_run(out)
    assert record["participating_processes"] == 2 and record["mixed_precision"] == HOST_PRECISION
    assert [(s["rows"], s["train"] + s["held_out"]) for s in record["data_sources"]] == [
        (150, 150),
        (250, 250),
        (50, 50),
    ]
    card = (out / "final" / "README.md").read_text()
    for source in record["data_sources"]:
        assert f"| source {source['source']} (train) | {source['train']} training rows |" in card

    stopped = tmp_path / "stopped"
    shutil.copytree(out / "checkpoints" / "step_3", stopped / "checkpoints" / "step_3")
    launch("ddp.yaml", "sft.py", args(stopped, resume_from_checkpoint="latest"))
    assert read_run(stopped)["data_sources"] == record["data_sources"]
    resumed = read_metrics(stopped)[0]
    assert [row["step"] for row in resumed] == [4, 5, 6]
    gap = max(abs(a - row["loss"]) for a, row in zip(losses(out)[3:], resumed))
    print(f"mixture: resumed-loss gap {gap:.2e} (bf16)")
    assert gap < 1e-6


def test_a_streamed_mixture_holds_out_each_sources_share_and_never_trains_on_it(tmp_path):
    """--streaming: 20 held-out documents taken 3:1 from the sources' first documents, each source
    skipping its own, so that no epoch (whose draws differ: set_epoch moves the interleaving) trains
    on one; sources whose columns differ are one line before anything streams."""
    from common.data.loading import load_raw_datasets
    from common.options.arguments import DataArguments

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(120)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": f"b{i}"}) + "\n" for i in range(40)))
    block = {
        "datasets": [
            {"id": str(tmp_path / "a.jsonl"), "weight": 3},
            {"id": str(tmp_path / "b.jsonl"), "columns": {"body": "text"}},
        ],
        "seed": 3,
    }
    args = DataArguments(dataset_mixture=json.dumps(block), streaming=True, max_eval_samples=20)
    raw = load_raw_datasets(args, seed=0)
    held = set(raw["validation"]["text"])
    assert len(held) == 20 and [c["held_out"] for c in args.mixture.counts] == [15, 5]
    assert held == {f"a{i}" for i in range(15)} | {f"b{i}" for i in range(5)}
    orders = []
    for epoch in range(3):
        raw["train"].set_epoch(epoch)
        orders.append([row["text"] for row in raw["train"]])
        assert orders[-1] and not held & set(orders[-1])
    assert orders[0] != orders[1]  # the epochs draw differently, and none reaches the held-out rows

    block["datasets"][1]["columns"] = ["body"]
    with pytest.raises(UsageError, match=r"b.jsonl has columns \['body'\] and .*a.jsonl \['text'\]; map them"):
        load_raw_datasets(DataArguments(dataset_mixture=json.dumps(block), streaming=True), seed=0)


def test_a_source_above_weight_1_repeats_each_row_it_trains_on_alike_and_says_so(tmp_path, capsys):
    """Issue 54, item 7: 30 rows at weight 2.0 with test_split_size 0.1 held 7 out and filled 53 training rows
    with the other 23, 16 of them twice and 7 three times, with no line saying so. Each row left for training
    now comes weight times (twice here), and the log line and run.json's counts say what was taken."""
    from common.data.mixture import describe_counts

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(30)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": f"b{i}"}) + "\n" for i in range(10)))
    block = {
        "datasets": [
            {"id": str(tmp_path / "a.jsonl"), "weight": 2.0},
            {"id": str(tmp_path / "b.jsonl"), "weight": 1.5},
        ],
        "test_split_size": 0.1,
        "seed": 0,
    }
    raw, counts = load(block)
    held = Counter(raw["validation"]["text"])
    trained = Counter(raw["train"]["text"])
    a, b = counts
    assert not set(held) & set(trained) and set(held.values()) == {1}
    assert Counter(n for row, n in trained.items() if row.startswith("a")) == {2: 30 - a["held_out"]}  # all twice
    assert a["train"] == 2 * (30 - a["held_out"]) and a["rows"] == a["train"] + a["held_out"]
    assert a["repeats"] == {"2": 30 - a["held_out"]}
    once_more = b["train"] - (10 - b["held_out"])  # 1.5 times its rows: half of them twice
    assert Counter(n for row, n in trained.items() if row.startswith("b")) == {
        1: 10 - b["held_out"] - once_more,
        2: once_more,
    }
    assert b["repeats"] == {"1": 10 - b["held_out"] - once_more, "2": once_more}
    assert len(raw["train"]) == a["train"] + b["train"]
    line = describe_counts(SimpleNamespace(counts=counts))
    assert (
        f"{a['source']}: {a['rows']} rows of its 30 (held out {a['held_out']}; train {a['train']}: its other {30 - a['held_out']} rows 2 times each)"
        in line
    )
    assert f"train {b['train']}: its other {10 - b['held_out']} rows, {once_more} of them 2 times)" in line


def test_a_folder_source_whose_answers_were_read_as_dates_is_one_line(tmp_path):
    """Issue 54, item 3: a source datasets reads itself (a folder, the Hub) cannot be read again as written: its
    text read as dates is refused in one line, where it was a refusal of the user's "conversation" that showed
    datetime.datetime(1971, 5, 8, 0, 0)."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    rows = [{"prompt": "When?", "chosen": "1971-05-08", "rejected": "1972-05-08"}] * 10
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError) as refused:
        load({"datasets": [{"id": str(folder)}]})
    assert str(refused.value) == (
        f"--dataset_mixture source {folder} split train: column 'chosen' was read as dates (Value('timestamp[s]')), "
        "not as the text written; its reader (pyarrow's JSON) guesses types: save the data as a local .jsonl file "
        "and pass that (local files are read as written)"
    )
