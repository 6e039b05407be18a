"""The general-conversation drafter's tools: prompt making (self-instruct, cleaning,
deduplication, the evaluation-set guard, the held-out split), the ``general`` and .jsonl
benchmark datasets, and the side-by-side drafter benchmark, on the tiny random target."""

from __future__ import annotations

import json

import pytest

import test_bench_demo
from dartcore.errors import CorpusError
from test_bench_demo import _load_tool, _tiny_index

# test_bench_demo's module-scoped fixture: the tiny target and drafter directories.
tiny_dirs = test_bench_demo.tiny_dirs


@pytest.fixture(scope="module")
def gp():
    return _load_tool("make_general_prompts")


def test_clean_request_keeps_requests_and_drops_residue(gp):
    assert gp.clean_request(' "How do I bake bread at home without yeast?"\nType: advice') == (
        "How do I bake bread at home without yeast?"
    )
    assert gp.clean_request(" Why?") is None  # too short
    assert gp.clean_request(" Topic: cooking Request: how") is None  # template residue
    assert gp.clean_request(" " + "word " * 120) is None  # too long
    # not the target's language
    assert gp.clean_request(" Что такое инфляция и почему растут цены?") is None
    assert gp.clean_request("\nWhat is a hash map") is None  # an empty first line


def _cand(text, source="self-instruct", task="advice"):
    return {"prompt": text, "source": source, "task": task}


def test_select_deduplicates_guards_eval_and_holds_out(gp):
    banned = gp._shingles(
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many", 8
    )
    cands = [
        _cand(t, "seed")
        for t in (
            "Seed request number one about cooking pasta.",
            "Seed request two about planting tulips in autumn.",
        )
    ]
    cands += [
        _cand(f"What is the best way to learn topic {i} quickly and remember it for years?")
        for i in range(3)
    ]
    cands += [
        _cand(f"Give me {i} ideas for a birthday party for a ten year old who loves {w}.")
        for i, w in enumerate(
            ["space", "dinosaurs", "trains", "robots", "horses", "music", "art", "ships"]
        )
    ]
    # normalised dup
    cands.append(_cand("what is the best way to learn topic 0 quickly, and remember it for years?"))
    cands.append(
        _cand(
            "So: Natalia sold clips to 48 of her friends in April, and then she sold half as many?"
        )
    )
    cands += [
        _cand(
            f"Summarise this text.\n\nPassage {i} about something else entirely.",
            "document",
            "summarise",
        )
        for i in range(40)
    ]
    kept, train, held, dropped = gp.select(cands, banned, 0.1, seed=0)
    assert dropped["duplicate"] == 1 and dropped["overlaps an evaluation prompt"] == 1
    # the numbered near-copies collapse (word 4-gram Jaccard >= 0.5) ...
    assert dropped["near-duplicate"] >= 2
    texts = [c["prompt"] for c in kept]
    assert sum("learn topic" in t for t in texts) == 1
    # ... but document prompts, whose instruction repeats by design, are all kept
    assert sum(c["source"] == "document" for c in kept) == 40
    assert len(train) + len(held) == len(kept) and not {id(c) for c in train} & {
        id(c) for c in held
    }
    assert 0 < len(held) <= round(0.1 * len(kept))
    assert all(c["source"] != "seed" for c in held)
    # the same inputs and seed give the same split
    again = gp.select(cands, banned, 0.1, seed=0)
    assert [c["prompt"] for c in again[2]] == [c["prompt"] for c in held]


def test_few_shot_page_is_seeded_and_ends_with_the_asked_request(gp):
    import random

    a = gp.few_shot_page(random.Random("0:5"), "poem", "birds")
    b = gp.few_shot_page(random.Random("0:5"), "poem", "birds")
    assert a == b and a.endswith("Type: poem\nTopic: birds\nRequest:")
    assert a.count("Request:") == 5


def test_self_instruct_appends_and_resumes(gp, tiny_dirs, tmp_path):
    import argparse

    target, _ = tiny_dirs
    args = argparse.Namespace(
        target=str(target), self_instruct=5, batch_size=3, seed=0, max_minutes=0.0
    )
    gp.self_instruct(args, tmp_path)
    rows = [json.loads(line) for line in open(tmp_path / "requests.jsonl")]
    assert [r["seed"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(
        r["task"] in gp.TASKS and r["topic"] in gp.TOPICS and isinstance(r["raw"], str)
        for r in rows
    )
    args.self_instruct = 7
    gp.self_instruct(args, tmp_path)  # continues with the next request seeds, keeps the first five
    again = [json.loads(line) for line in open(tmp_path / "requests.jsonl")]
    assert again[:5] == rows and [r["seed"] for r in again] == list(range(7))


def test_general_and_jsonl_datasets(tmp_path):
    from dartcore.benchmark.datasets import GENERAL_PROMPTS, load_prompts

    assert GENERAL_PROMPTS.is_file()
    general = load_prompts("general", 1000)
    assert len(general) >= 20 and all(
        m[-1]["role"] == "user" and m[-1]["content"].strip() for m in general
    )
    assert load_prompts("general", 3) == general[:3]
    f = tmp_path / "mine.jsonl"
    f.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi?"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "dropped"},
                ]
            }
        )
        + "\n"
        + json.dumps({"prompt": "Say yes."})
        + "\n"
    )
    got = load_prompts(str(f), 5)
    assert got[0][-1] == {"role": "user", "content": "Name a colour."} and len(got[0]) == 4
    assert got[1] == [{"role": "user", "content": "Say yes."}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt here"}) + "\n")
    with pytest.raises(CorpusError, match="bad.jsonl:1"):
        load_prompts(str(bad), 1)
    bad.write_text("{not json\n")
    with pytest.raises(CorpusError, match="cannot read prompts"):
        load_prompts(str(bad), 1)
    with pytest.raises(CorpusError, match="no such prompt file"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_bench_drafters_side_by_side(tiny_dirs, tmp_path, capsys):
    from dartcore.drafter import DartDrafter
    from dartcore.models.hub import load_target

    tool = _load_tool("bench_drafters")
    target, drafter_dir = tiny_dirs
    index = _tiny_index(target, tmp_path)
    model, tok = load_target(str(target))
    other = tmp_path / "other-drafter"
    import torch

    torch.manual_seed(1)
    DartDrafter.from_target(model, d=4, target_name="tiny-llama", tokenizer=tok).save_pretrained(
        other
    )
    out = tmp_path / "bd.json"
    code = tool.main(
        [
            "--target",
            str(target),
            "--variant",
            f"a={drafter_dir}@{index}",
            "--variant",
            f"b={other}@{index}",
            "--datasets",
            "builtin",
            "--n",
            "2",
            "--max-new-tokens",
            "10",
            "--json",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "greedy outputs identical to AR: True" in printed
    report = json.loads(out.read_text())
    rows = report["rows"]
    decode = [(r["variant"], r["method"]) for r in rows if r["method"] != "hit-rates"]
    assert decode == [
        ("-", "ar"),
        ("a", "dart"),
        ("a", "dart+ctx"),
        ("b", "dart"),
        ("b", "dart+ctx"),
    ]
    hits = {r["variant"]: r for r in rows if r["method"] == "hit-rates"}
    assert set(hits) == {"a", "b"}
    for r in hits.values():
        assert len(r["hit1"]) == 4 and all(0.0 <= x <= 1.0 for x in r["hit1"] + r["top10"])
        assert all(t >= h for h, t in zip(r["hit1"], r["top10"])) and r["count"][0] > 0
    with pytest.raises(SystemExit):
        tool.main(["--variant", "nolabel"])
    with pytest.raises(SystemExit):
        tool.main(["--variant", f"a={drafter_dir}", "--variant", f"a={other}"])
