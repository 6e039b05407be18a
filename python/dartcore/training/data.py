"""Training text for dart-train: reading, chat formatting, tokenising, packing.

Accepted inputs (one file or a directory of them):

* chat / instruction JSON (a list) and JSONL: records with ``messages`` / ``conversations``
  (``role``/``content`` or ``from``/``value``), ``question``/``answer`` (GSM8K),
  ``instruction``/``input``/``output`` or ``response`` (CodeAlpaca), ``prompt`` (+ optional
  ``completion`` / ``response``; prompt-only records are eval prompts);
* Dolma documents (``.json.gz`` / ``.json.zst`` / ``.jsonl[.gz|.zst]`` with a ``text`` field);
* plain text (``.txt`` / ``.md``): one document per file.

Chat records are rendered with the target's chat template; the assistant's response tokens
are the positions we draft for (``respond`` mask). Plain documents are all "response".
"""

from __future__ import annotations

import gzip
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dartcore.errors import CorpusError

__all__ = ["Document", "read_documents", "tokenize_document", "pack_documents", "PackedSequence"]


@dataclass
class Document:
    messages: list[dict] | None = None  # chat: [{"role", "content"}, ...]
    text: str | None = None  # plain text document

    @property
    def has_response(self) -> bool:
        return self.text is not None or (
            bool(self.messages) and self.messages[-1]["role"] == "assistant"
        )


def _open_text(path: Path):
    name = path.name
    if name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    if name.endswith(".zst"):
        import zstandard

        return io.TextIOWrapper(
            zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8"
        )
    return open(path, encoding="utf-8")


def _record_to_document(rec: dict, where: str) -> Document:
    if not isinstance(rec, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for key in ("messages", "conversations"):
        if key in rec:
            msgs = []
            for m in rec[key]:
                role = m.get("role", m.get("from"))
                content = m.get("content", m.get("value"))
                role = {"human": "user", "gpt": "assistant"}.get(role, role)
                if role not in ("system", "user", "assistant") or not isinstance(content, str):
                    raise CorpusError(f"{where}: bad message {m!r}")
                msgs.append({"role": role, "content": content})
            return Document(messages=msgs)
    if "question" in rec:
        msgs = [{"role": "user", "content": rec["question"]}]
        if rec.get("answer"):
            msgs.append({"role": "assistant", "content": rec["answer"]})
        return Document(messages=msgs)
    if "instruction" in rec:
        user = rec["instruction"]
        if rec.get("input"):
            user = f"{user}\n\n{rec['input']}"
        msgs = [{"role": "user", "content": user}]
        out = rec.get("output") or rec.get("response")
        if out:
            msgs.append({"role": "assistant", "content": out})
        return Document(messages=msgs)
    if "prompt" in rec:
        msgs = [{"role": "user", "content": rec["prompt"]}]
        out = rec.get("completion") or rec.get("response")
        if out:
            msgs.append({"role": "assistant", "content": out})
        return Document(messages=msgs)
    if "text" in rec:
        return Document(text=rec["text"])
    raise CorpusError(
        f"{where}: no known fields (messages, question/answer, instruction/output, prompt, text) in {sorted(rec)}"
    )


def _read_file(path: Path) -> list[Document]:
    name = path.name.lower()
    base = name[:-3] if name.endswith(".gz") else name[:-4] if name.endswith(".zst") else name
    try:
        if base.endswith(".txt") or base.endswith(".md"):
            with _open_text(path) as f:
                return [Document(text=f.read())]
        with _open_text(path) as f:
            raw = f.read()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise CorpusError(f"cannot read {path}: {exc}") from exc
    stripped = raw.lstrip()
    if base.endswith(".json") and stripped.startswith("["):
        try:
            records = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{path}: invalid JSON: {exc}") from exc
        return [_record_to_document(r, f"{path}[{i}]") for i, r in enumerate(records)]
    if base.endswith(".json") or base.endswith(".jsonl"):
        docs = []
        for i, line in enumerate(raw.splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{i + 1}: invalid JSON line: {exc}") from exc
            docs.append(_record_to_document(rec, f"{path}:{i + 1}"))
        return docs
    raise CorpusError(
        f"{path}: unknown file type (expected .json, .jsonl, Dolma .json.gz/.zst, .txt, .md)"
    )


def read_documents(paths) -> list[Document]:
    """All documents of the given files / directories, in a deterministic order."""
    docs: list[Document] = []
    for p in [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not files:
                raise CorpusError(f"{p}: empty directory")
            for f in files:
                docs.extend(_read_file(f))
        elif p.is_file():
            docs.extend(_read_file(p))
        else:
            raise CorpusError(f"no such training file or directory: {p}")
    if not docs:
        raise CorpusError(f"no documents in {paths}")
    return docs


def tokenize_document(doc: Document, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, respond mask): respond[i] is True where token i belongs to the response."""
    if doc.text is not None:
        ids = tokenizer.encode(doc.text, add_special_tokens=False)
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        ids = np.asarray(ids, dtype=np.int64)
        return ids, np.ones(len(ids), dtype=bool)
    msgs = doc.messages
    if msgs[-1]["role"] != "assistant":
        ids = _chat_ids(tokenizer, msgs, add_generation_prompt=True)
        return ids, np.zeros(len(ids), dtype=bool)
    full = _chat_ids(tokenizer, msgs, add_generation_prompt=False)
    prompt = _chat_ids(tokenizer, msgs[:-1], add_generation_prompt=True)
    if not np.array_equal(full[: len(prompt)], prompt):
        raise CorpusError(
            "chat template: the prompt's tokens are not a prefix of the full conversation's"
        )
    respond = np.zeros(len(full), dtype=bool)
    respond[len(prompt) :] = True
    return full, respond


def _chat_ids(tokenizer, messages, *, add_generation_prompt: bool) -> np.ndarray:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return np.asarray(out, dtype=np.int64)


@dataclass
class PackedSequence:
    input_ids: np.ndarray  # [N]
    position_ids: np.ndarray  # [N] restart at 0 for every document
    doc_ids: np.ndarray  # [N] 0, 1, ... (padding: its own document)
    anchor_ok: np.ndarray  # [N] t may be an anchor: t+1 is a response token of the same document
    doc_end: np.ndarray  # [N] index of the last token of t's document


def pack_documents(
    tokenized: list[tuple[np.ndarray, np.ndarray]],
    ctx_len: int,
    *,
    pad_id: int = 0,
    seed: int | None = None,
) -> list[PackedSequence]:
    """Greedy packing into sequences of exactly ``ctx_len`` tokens (documents longer than
    ``ctx_len`` are truncated to it; the tail of each sequence is padding)."""
    order = list(range(len(tokenized)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    seqs: list[PackedSequence] = []
    cur: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0

    def flush():
        nonlocal cur, used
        if not cur:
            return
        ids = np.full(ctx_len, pad_id, dtype=np.int64)
        pos = np.zeros(ctx_len, dtype=np.int64)
        doc = np.zeros(ctx_len, dtype=np.int64)
        ok = np.zeros(ctx_len, dtype=bool)
        end = np.zeros(ctx_len, dtype=np.int64)
        o = 0
        for di, (t, r) in enumerate(cur):
            n = len(t)
            ids[o : o + n] = t
            pos[o : o + n] = np.arange(n)
            doc[o : o + n] = di
            ok[o : o + n - 1] = r[1:]
            end[o : o + n] = o + n - 1
            o += n
        if o < ctx_len:
            pos[o:] = np.arange(ctx_len - o)
            doc[o:] = len(cur)
            end[o:] = ctx_len - 1
        seqs.append(PackedSequence(ids, pos, doc, ok, end))
        cur, used = [], 0

    for i in order:
        ids, resp = tokenized[i]
        ids, resp = ids[:ctx_len], resp[:ctx_len]
        if len(ids) < 2 or not resp[1:].any():
            continue
        if used + len(ids) > ctx_len:
            flush()
        cur.append((ids, resp))
        used += len(ids)
    flush()
    return seqs
