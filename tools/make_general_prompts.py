#!/usr/bin/env python3
"""General-conversation training prompts for the drafter, made on this machine with no download.

    python3 tools/make_general_prompts.py --out artifacts/general --self-instruct 1400 --documents 500

Two sources, each prompt tagged with where it came from:

* ``self-instruct``: the target itself writes user requests. A plain-text few-shot page (four
  requests drawn from the hand-written ``SEEDS`` below, each labelled with its task type and
  topic) ends with a task type and a topic from ``TASKS`` x ``TOPICS``; the target, sampled
  (T = 0.9, top-p 0.95, seeded per request), completes the line. Generated lines are appended
  to ``requests.jsonl`` as soon as a batch is done, so a run cut short (``--max-minutes``, a
  crash) keeps what it made and a rerun continues with the next request seeds.
* ``document``: an instruction (summarise, explain, rewrite, answer a question about it, ...)
  applied to a passage of text that ships with this machine: the Dolma sample documents under
  ``$DARTCORE_DATA/dolma-sample``, the Debian package documentation under /usr/share/doc, and
  the docstrings of the Python standard library. No model is run for these.

Then every candidate is cleaned (one line, 4-90 words, no template residue), deduplicated
(normalised text, and word 4-gram Jaccard >= 0.5 with an earlier one), checked against the
evaluation sets (a prompt sharing any 8-word run with a HumanEval / GSM8K-test /
CodeAlpaca-2k prompt is dropped), shuffled with ``--seed``, and split: ``--heldout-frac`` of
them (5 %) to ``heldout.jsonl`` (never trained on; ``dart-bench --datasets general`` reads them
from the copy shipped in ``dartcore/assets/eval/``), the rest to ``train.jsonl`` (one
``{"messages": [{"role": "user", ...}], "source": ...}`` line each, what
``tools/generate_target_responses.py --data`` reads). ``README.md`` beside them records the
counts per source and task type and the command.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

TASKS = [
    "creative writing",
    "email or letter",
    "advice",
    "explain a concept",
    "how-to steps",
    "comparison",
    "reasoning puzzle",
    "role-play",
    "information extraction",
    "summarise",
    "brainstorm a list",
    "rewrite or edit",
    "recommendation",
    "planning",
    "factual question",
    "coding question",
    "classification",
    "opinion",
    "definition",
    "short story",
    "poem",
    "debate",
    "interview practice",
    "math word problem",
]

TOPICS = [
    "cooking",
    "travel",
    "personal finance",
    "fitness",
    "history",
    "astronomy",
    "biology",
    "music",
    "movies",
    "job interviews",
    "parenting",
    "pets",
    "gardening",
    "climate",
    "web development",
    "statistics",
    "psychology",
    "philosophy",
    "economics",
    "everyday law",
    "health",
    "sleep",
    "productivity",
    "learning languages",
    "literature",
    "sports",
    "video games",
    "photography",
    "cars",
    "home repair",
    "fashion",
    "friendship",
    "school",
    "chemistry",
    "physics",
    "geography",
    "painting",
    "architecture",
    "marketing",
    "small business",
    "social media",
    "oceans",
    "computers",
    "online security",
    "mythology",
    "board games",
    "weather",
    "nutrition",
    "hiking",
    "public speaking",
    "time management",
    "volunteering",
    "birds",
    "insects",
    "renewable energy",
    "space exploration",
    "ancient Rome",
    "the Middle Ages",
    "inventions",
    "medicine",
    "dinosaurs",
    "coffee and tea",
    "city life",
    "farming",
    "art history",
    "robots",
    "mobile phones",
    "shopping",
    "customer service",
    "holidays",
    "weddings",
    "moving house",
    "budget travel",
    "data science",
    "spreadsheets",
    "Linux",
    "databases",
    "machine learning",
    "ethics",
    "mountains",
    "rivers",
    "baking",
    "camping",
    "cycling",
    "running",
    "yoga",
    "meditation",
    "writing a resume",
    "negotiation",
    "team management",
    "electric cars",
    "the human brain",
    "genetics",
    "volcanoes",
]

# Hand-written examples of the requests wanted: (task type, topic, request).
SEEDS = [
    (
        "advice",
        "gardening",
        "My tomato plants have yellow leaves at the bottom. What could be causing it and what should I do?",
    ),
    (
        "explain a concept",
        "economics",
        "Can you explain inflation in simple terms, with an everyday example?",
    ),
    (
        "creative writing",
        "oceans",
        "Write a short description of a stormy night at sea from the point of view of a lighthouse keeper.",
    ),
    (
        "email or letter",
        "job interviews",
        "Write a polite email thanking an interviewer for their time and asking about the next steps.",
    ),
    (
        "how-to steps",
        "home repair",
        "How do I fix a leaking kitchen tap? Give me the steps in order.",
    ),
    (
        "comparison",
        "mobile phones",
        "What are the main differences between buying a phone outright and getting one on a contract?",
    ),
    (
        "reasoning puzzle",
        "board games",
        "If I roll two dice, what is the chance that the total is seven? Explain your reasoning.",
    ),
    (
        "role-play",
        "travel",
        "Pretend you are a hotel receptionist and I am a guest who has lost my room key. Start the conversation.",
    ),
    (
        "information extraction",
        "customer service",
        "From this message, list the product, the problem and what the customer wants: 'My blender arrived with a cracked jar and I would like a replacement.'",
    ),
    (
        "summarise",
        "health",
        "Summarise the benefits of regular walking in three short bullet points.",
    ),
    (
        "brainstorm a list",
        "small business",
        "Give me ten name ideas for a small bakery that sells bread and cakes.",
    ),
    (
        "rewrite or edit",
        "writing a resume",
        "Rewrite this sentence so it sounds more professional: 'I did lots of stuff with computers at my last job.'",
    ),
    (
        "recommendation",
        "literature",
        "I enjoyed reading The Hobbit. What other books might I like, and why?",
    ),
    (
        "planning",
        "fitness",
        "Make a simple four-week plan for a beginner who wants to run five kilometres.",
    ),
    ("factual question", "astronomy", "Why does the Moon always show the same face to the Earth?"),
    (
        "coding question",
        "web development",
        "How can I center a div horizontally and vertically with CSS?",
    ),
    (
        "classification",
        "nutrition",
        "Sort these foods into fruits, vegetables and grains: rice, apple, carrot, oats, banana, spinach.",
    ),
    (
        "opinion",
        "city life",
        "Is it better to live in a big city or a small town when you are young? Give arguments for both.",
    ),
    ("definition", "machine learning", "What does overfitting mean in machine learning?"),
    ("short story", "robots", "Write a very short story about a robot that learns to paint."),
    ("poem", "weather", "Write a four-line poem about the first snow of winter."),
    ("debate", "social media", "Give two arguments for and two against banning phones in schools."),
    (
        "interview practice",
        "team management",
        "Ask me three questions a manager might be asked in an interview, one at a time.",
    ),
    (
        "math word problem",
        "shopping",
        "A shirt costs 25 dollars and is on sale for 20 percent off. How much do I pay?",
    ),
    ("explain a concept", "genetics", "What is DNA and how does it carry information?"),
    ("advice", "sleep", "I keep waking up at 3 am and cannot fall back asleep. Any tips?"),
    ("how-to steps", "spreadsheets", "How do I make a drop-down list in a spreadsheet cell?"),
    ("factual question", "ancient Rome", "Who was Julius Caesar and why is he famous?"),
]

DOC_TEMPLATES = [
    ("summarise", "Summarise the following text in a few sentences.\n\n{p}"),
    (
        "explain a concept",
        "Explain the following passage in simple terms, as if to a beginner.\n\n{p}",
    ),
    ("summarise", "What are the key points of this text? Answer with a short list.\n\n{p}"),
    (
        "rewrite or edit",
        "Rewrite the following text so that it is clearer and easier to read.\n\n{p}",
    ),
    (
        "factual question",
        "Read the text below and explain what problem or topic it is about.\n\n{p}",
    ),
    (
        "information extraction",
        "List the names, numbers and technical terms that appear in this text, and say briefly what each one refers to.\n\n{p}",
    ),
    (
        "creative writing",
        "Write a short, catchy title and a one-paragraph introduction for the following text.\n\n{p}",
    ),
    (
        "factual question",
        "{p}\n\nBased on the text above, what would a reader need to know before using this?",
    ),
    (
        "rewrite or edit",
        "Turn the following text into three questions and answers (a small FAQ).\n\n{p}",
    ),
    (
        "explain a concept",
        "{p}\n\nExplain the most important idea in this passage and give an example.",
    ),
]


def few_shot_page(rng: random.Random, task: str, topic: str) -> str:
    lines = [
        "Below are requests that different people sent to a helpful AI assistant. Each one is a",
        "complete, specific message written by the user.",
        "",
    ]
    for t, tp, req in rng.sample(SEEDS, 4):
        lines += [f"Type: {t}", f"Topic: {tp}", f"Request: {req}", ""]
    lines += [f"Type: {task}", f"Topic: {topic}", "Request:"]
    return "\n".join(lines)


def clean_request(text: str) -> str | None:
    """The generated line as a request, or None when it is not one."""
    text = text.split("\n", 1)[0].strip().strip('"').strip()
    if not text or re.search(r"\b(Type|Topic|Request):", text):
        return None
    words = text.split()
    if not 4 <= len(words) <= 90:
        return None
    if sum(c.isascii() for c in text) < 0.95 * len(text):
        return None
    if text[-1] not in ".?!:)'\"" and len(words) < 8:
        return None
    return text


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _shingles(text: str, n: int = 4) -> set:
    w = _norm(text).split()
    return {" ".join(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}


def self_instruct(args, out: Path) -> None:
    """Append generated requests to requests.jsonl until --self-instruct lines exist."""
    import torch

    from dartcore.models.hub import load_target

    path = out / "requests.jsonl"
    have = sum(1 for _ in open(path, encoding="utf-8")) if path.exists() else 0
    if have >= args.self_instruct:
        print(f"self-instruct: {have} requests already in {path}", file=sys.stderr)
        return
    model, tok = load_target(args.target, quantized=False)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.time()
    with open(path, "a", encoding="utf-8") as f:
        while have < args.self_instruct:
            if args.max_minutes and time.time() - t0 > args.max_minutes * 60:
                print("self-instruct: --max-minutes reached", file=sys.stderr)
                break
            batch = []
            for j in range(have, min(have + args.batch_size, args.self_instruct)):
                rng = random.Random(f"{args.seed}:{j}")
                task, topic = rng.choice(TASKS), rng.choice(TOPICS)
                batch.append((j, task, topic, few_shot_page(rng, task, topic)))
            enc = tok([b[3] for b in batch], return_tensors="pt", padding=True)
            torch.manual_seed(args.seed * 1_000_003 + have)
            with torch.inference_mode():
                gen = model.generate(
                    **enc,
                    max_new_tokens=72,
                    do_sample=True,
                    temperature=0.9,
                    top_p=0.95,
                    pad_token_id=pad,
                    stop_strings=["\n"],
                    tokenizer=tok,
                )
            width = enc["input_ids"].shape[1]
            for i, (j, task, topic, _) in enumerate(batch):
                text = tok.decode(gen[i, width:], skip_special_tokens=True)
                f.write(json.dumps({"seed": j, "task": task, "topic": topic, "raw": text}) + "\n")
            f.flush()
            have += len(batch)
            print(
                f"self-instruct: {have}/{args.self_instruct} requests, {(time.time() - t0) / 60:.1f} min",
                file=sys.stderr,
                flush=True,
            )


def _passages(text: str, rng: random.Random, lo: int = 300, hi: int = 900) -> list[str]:
    """Paragraph-aligned passages of lo..hi characters."""
    paras = [re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    paras = [p for p in paras if len(p) >= 40 and sum(c.isalpha() for c in p) > 0.6 * len(p)]
    out, cur = [], ""
    for p in paras:
        cur = (cur + "\n\n" + p).strip() if cur else p
        if len(cur) >= lo:
            out.append(cur[:hi].rsplit(" ", 1)[0] if len(cur) > hi else cur)
            cur = ""
    rng.shuffle(out)
    return out


def _doc_texts(data_dir: Path) -> dict[str, list[tuple[str, str]]]:
    """(origin, text) per document source."""
    dolma = []
    for f in sorted((data_dir / "dolma-sample" / "documents").glob("*.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    rec = json.loads(line)
                    dolma.append((f"dolma-sample:{rec.get('id', f.name)}", rec.get("text", "")))
    debian = []
    for f in sorted(Path("/usr/share/doc").rglob("*")):
        name = f.name.lower()
        if not f.is_file() or "copyright" in name or "changelog" in name or "news" in name:
            continue
        if not any(k in name for k in ("readme", ".txt", ".md", "faq", "howto")):
            continue
        try:
            opener = gzip.open if name.endswith(".gz") else open
            with opener(f, "rt", encoding="utf-8") as fh:
                debian.append(
                    (f"usr-share-doc:{f.relative_to('/usr/share/doc')}", fh.read(200_000))
                )
        except (OSError, UnicodeDecodeError, EOFError):
            continue
    pydoc = []
    stdlib = Path(ast.__file__).parent
    for f in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))
        ]:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 300:
                label = getattr(node, "name", "<module>")
                pydoc.append((f"python-stdlib:{f.stem}.{label}", doc))
    return {"dolma-sample": dolma, "usr-share-doc": debian, "python-stdlib": pydoc}


def document_prompts(args, data_dir: Path) -> list[dict]:
    rng = random.Random(args.seed)
    sources = _doc_texts(data_dir)
    per = {"dolma-sample": 0.4, "usr-share-doc": 0.35, "python-stdlib": 0.25}
    out = []
    for name, docs in sources.items():
        want = int(args.documents * per[name])
        pool = []
        for origin, text in docs:
            pool.extend((origin, p) for p in _passages(text, rng)[:3])
        rng.shuffle(pool)
        for origin, passage in pool[:want]:
            task, tpl = rng.choice(DOC_TEMPLATES)
            out.append(
                {
                    "prompt": tpl.format(p=passage),
                    "source": "document",
                    "origin": origin,
                    "task": task,
                }
            )
        print(
            f"documents: {min(want, len(pool))} prompts from {name} ({len(docs)} documents)",
            file=sys.stderr,
        )
    return out


def eval_shingles(data_dir: Path) -> set:
    from dartcore.benchmark.datasets import _user_texts

    grams = set()
    for ds in ("humaneval", "gsm8k", "code_alpaca"):
        for t in _user_texts(ds, data_dir):
            grams |= _shingles(t, 8)
    return grams


def select(cands: list[dict], banned: set, heldout_frac: float, seed: int):
    """Deduplicate, drop what overlaps an evaluation prompt (``banned``: its 8-word shingles),
    shuffle and split. Returns (kept, train, held, dropped counts); hand-written seeds are
    never held out. Document prompts skip the near-duplicate test (their instruction
    templates repeat by design; their passages differ)."""
    seen_norm, kept, kept_sh = set(), [], []
    dropped = Counter()
    index: dict[str, list[int]] = {}
    for c in cands:
        n = _norm(c["prompt"])
        if n in seen_norm:
            dropped["duplicate"] += 1
            continue
        if _shingles(c["prompt"], 8) & banned:
            dropped["overlaps an evaluation prompt"] += 1
            continue
        sh = _shingles(c["prompt"]) if c["source"] != "document" else set()
        near = set()
        for g in sh:
            near.update(index.get(g, ()))
        if any(len(sh & kept_sh[k]) / len(sh | kept_sh[k]) >= 0.5 for k in near):
            dropped["near-duplicate"] += 1
            continue
        seen_norm.add(n)
        for g in sh:
            index.setdefault(g, []).append(len(kept))
        kept.append(c)
        kept_sh.append(sh)
    order = list(range(len(kept)))
    random.Random(seed + 7).shuffle(order)
    n_held = max(1, round(heldout_frac * len(kept)))
    held_idx = set(i for i in order[:n_held] if kept[i]["source"] != "seed")
    held = [kept[i] for i in order if i in held_idx]
    train = [kept[i] for i in order if i not in held_idx]
    return kept, train, held, dict(dropped)


def assemble(args, out: Path, data_dir: Path) -> dict:
    cands = [{"prompt": s[2], "source": "seed", "task": s[0], "topic": s[1]} for s in SEEDS]
    raw = 0
    path = out / "requests.jsonl"
    if path.exists():
        for line in open(path, encoding="utf-8"):
            rec = json.loads(line)
            raw += 1
            text = clean_request(rec["raw"])
            if text:
                cands.append(
                    {
                        "prompt": text,
                        "source": "self-instruct",
                        "task": rec["task"],
                        "topic": rec["topic"],
                    }
                )
    n_self = len(cands) - len(SEEDS)
    cands += document_prompts(args, data_dir)
    kept, train, held, dropped = select(
        cands, eval_shingles(data_dir), args.heldout_frac, args.seed
    )
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        tmp = out / (name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                rec = {
                    "messages": [{"role": "user", "content": r["prompt"]}],
                    "source": r["source"],
                    "task": r["task"],
                }
                if "origin" in r:
                    rec["origin"] = r["origin"]
                f.write(json.dumps(rec) + "\n")
        tmp.replace(out / name)
    return {
        "raw_self_instruct": raw,
        "clean_self_instruct": n_self,
        "candidates": len(cands),
        "kept": len(kept),
        "dropped": dropped,
        "train": len(train),
        "heldout": len(held),
        "by_source": dict(Counter(r["source"] for r in kept)),
        "by_origin": dict(
            Counter(r.get("origin", "").split(":")[0] for r in kept if "origin" in r)
        ),
        "by_task": dict(Counter(r["task"] for r in kept).most_common()),
    }


def write_readme(out: Path, stats: dict, argv: list[str]) -> None:
    lines = [
        "# General-conversation prompts",
        "",
        "Made by `tools/make_general_prompts.py` on this machine, no download. Command:",
        "",
        "    python3 tools/make_general_prompts.py " + " ".join(argv),
        "",
        "| file | what |",
        "|---|---|",
        "| requests.jsonl | every raw line the target wrote (self-instruct), with its request seed, task type and topic |",
        f'| train.jsonl | {stats["train"]} prompts for training (`{{"messages": [user], "source", "task"[, "origin"]}}`) |',
        f"| heldout.jsonl | {stats['heldout']} prompts held out ({stats['heldout'] / max(1, stats['kept']):.1%}), never trained on |",
        "",
        "Provenance:",
        "",
        f"- `seed`: {stats['by_source'].get('seed', 0)} hand-written requests (`SEEDS` in the script; training only).",
        f"- `self-instruct`: {stats['by_source'].get('self-instruct', 0)} requests written by SmolLM2-135M-Instruct "
        f"(sampled, T = 0.9, top-p 0.95) from a few-shot page of four seed requests and a task type x topic "
        f"({stats['raw_self_instruct']} lines generated, {stats['clean_self_instruct']} clean before deduplication).",
        f"- `document`: {stats['by_source'].get('document', 0)} instructions over passages of local text: "
        + ", ".join(f"{k} {v}" for k, v in stats["by_origin"].items())
        + " (`origin` names the document: a Dolma sample id, a path under /usr/share/doc, or a standard-library"
        " module and object whose docstring it is).",
        "",
        "Dropped: "
        + (", ".join(f"{k} {v}" for k, v in stats["dropped"].items()) or "none")
        + ". No prompt shares an 8-word run with any HumanEval, GSM8K-test or CodeAlpaca-2k prompt.",
        "",
        "Task types: " + ", ".join(f"{k} {v}" for k, v in stats["by_task"].items()) + ".",
        "",
        "Licences: the seed requests and templates are this project's; the passages keep their sources'"
        " licences (Dolma sample: ODC-BY; Debian documentation: each package's; Python: PSF).",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="smollm2")
    p.add_argument(
        "--self-instruct", type=int, default=1400, help="requests the target writes (raw lines)"
    )
    p.add_argument("--documents", type=int, default=500, help="document-grounded prompts")
    p.add_argument("--heldout-frac", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--max-minutes", type=float, default=0.0, help="stop the self-instruct step after this long"
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--data-dir",
        default=None,
        help="data directory with eval/ and dolma-sample/ (default: $DARTCORE_DATA)",
    )
    args = p.parse_args(argv)
    if (
        args.self_instruct < 0
        or args.documents < 0
        or not 0 < args.heldout_frac < 1
        or args.batch_size < 1
    ):
        p.error(
            "--self-instruct/--documents must be >= 0, --batch-size >= 1, 0 < --heldout-frac < 1"
        )
    import torch

    from dartcore.benchmark.datasets import find_data_dir

    data_dir = find_data_dir(args.data_dir)
    if data_dir is None:
        p.error(
            "no data directory with eval/ and dolma-sample/: pass --data-dir or set DARTCORE_DATA"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.self_instruct:
        self_instruct(args, out)
    stats = assemble(args, out, data_dir)
    write_readme(out, stats, sys.argv[1:] if argv is None else list(argv))
    print(json.dumps(stats, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
