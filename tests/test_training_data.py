"""dart-train input: the public chat/instruction formats, Dolma documents, plain text, bad
input; chat-template tokenisation and the CLI end to end (real SmolLM2: slow)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from dartcore.errors import CorpusError
from dartcore.training.data import Document, read_documents, tokenize_document


def _lines(path) -> int:
    """Records of a JSONL file, counted independently of the reader."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def test_training_and_eval_formats(test_data):
    gsm = read_documents(test_data / "train" / "gsm8k_train.jsonl")
    n_gsm = _lines(test_data / "train" / "gsm8k_train.jsonl")
    assert len(gsm) == n_gsm >= 12
    assert [m["role"] for m in gsm[0].messages] == ["user", "assistant"]
    assert gsm[0].messages[0]["content"].startswith("Natalia sold clips")
    assert gsm[0].messages[1]["content"].endswith("#### 72")
    code = read_documents(test_data / "train" / "new_codealpaca.json")
    n_code = len(json.loads((test_data / "train" / "new_codealpaca.json").read_text()))
    assert len(code) == n_code >= 12 and all(d.has_response for d in code)
    assert "width: 5, height: 8" in code[0].messages[0]["content"]  # instruction + input
    both = read_documents(test_data / "train")
    assert len(both) == n_gsm + n_code
    he = read_documents(test_data / "eval" / "humaneval.jsonl.gz")
    # prompts only
    assert len(he) == _lines(test_data / "eval" / "humaneval.jsonl.gz") and not he[0].has_response
    alp = read_documents(test_data / "eval" / "code_alpaca_2k.json")
    assert (
        len(alp) == len(json.loads((test_data / "eval" / "code_alpaca_2k.json").read_text()))
        and alp[0].has_response
    )
    dolma = read_documents(test_data / "dolma-sample" / "documents")
    assert len(dolma) >= 30 and all(d.text for d in dolma)


def test_formats_in_tmp(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n\n"
        + json.dumps(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        )
        + "\n"
    )
    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        f.write(json.dumps({"id": "1", "text": "doc one", "source": "x"}) + "\n")
    (tmp_path / "c.txt").write_text("plain text\nfile")
    docs = read_documents(tmp_path)
    assert [m["role"] for m in docs[0].messages] == ["system", "user", "assistant"]
    assert docs[1].messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert docs[2].text == "doc one" and docs[3].text == "plain text\nfile"


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "invalid JSON"),
        ('{"foo": 1}', "no known fields"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "bad message"),
    ],
)
def test_bad_input_is_a_corpus_error(tmp_path, content, match):
    (tmp_path / "x.jsonl").write_text(content + "\n")
    with pytest.raises(CorpusError, match=match):
        read_documents(tmp_path / "x.jsonl")


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(CorpusError, match="no such"):
        read_documents(tmp_path / "nope.jsonl")
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(CorpusError, match="unknown file type"):
        read_documents(tmp_path / "x.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="empty"):
        read_documents(tmp_path / "empty")


@pytest.mark.slow
def test_chat_template_response_mask(smollm2):
    _, tok = smollm2
    doc = Document(
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
        ]
    )
    ids, resp = tokenize_document(doc, tok)
    text = tok.decode(ids[resp])
    assert text.startswith("4.") and "<|im_end|>" in text
    assert "What is 2+2?" in tok.decode(ids[~resp]) and tok.decode(ids[~resp]).endswith(
        "assistant\n"
    )
    plain_ids, plain_resp = tokenize_document(Document(text="hello world"), tok)
    assert plain_resp.all() and plain_ids[-1] == tok.eos_token_id
    prompt_ids, prompt_resp = tokenize_document(Document(messages=doc.messages[:1]), tok)
    assert not prompt_resp.any() and np.array_equal(prompt_ids, ids[: len(prompt_ids)])


@pytest.mark.slow
def test_cli_train_resume_export_eval(tmp_path, test_data, smollm2):
    import torch

    from dartcore.cli.dart_train import main
    from dartcore.drafter import DartDrafter

    data = tmp_path / "train.jsonl"
    with open(test_data / "train" / "gsm8k_train.jsonl") as f:
        data.write_text("".join(next(f) for _ in range(12)))
    out = tmp_path / "run"
    common = [
        "--target",
        "smollm2",
        "--data",
        str(data),
        "--out",
        str(out),
        "--holdout",
        "2",
        "--ctx-len",
        "256",
        "--batch-size",
        "1",
        "--anchors",
        "16",
        "--draft-vocab",
        "2048",
        "--warmup",
        "1",
        "--eval-every",
        "0",
        "--no-progress",
        "--threads",
        "1",
    ]
    assert main(common + ["--max-steps", "1"]) == 0
    assert main(common + ["--max-steps", "2", "--resume", "--export", str(tmp_path / "exp")]) == 0
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if not r.get("eval")] == [1, 2]
    model, tok = smollm2
    dr = DartDrafter.from_pretrained(tmp_path / "exp", model, tokenizer=tok)
    assert dr.config.draft_vocab_size == 2048 and dr.config.target_name == "smollm2"
    assert main(common + ["--eval-only", "--drafter", str(tmp_path / "exp")]) == 0
    res = json.loads((out / "eval_data.json").read_text())
    assert len(res["hit1"]) == 8 and res["responses"] == "taken from the data"
    assert main(["--target", "smollm2", "--data", str(tmp_path / "missing.jsonl")]) == 2
    # --init: fine-tuning starts from the given drafter (lr 0 leaves it unchanged) and keeps its
    # draft vocabulary whatever --draft-vocab says
    tuned = [
        "--out",
        str(tmp_path / "tuned"),
        "--init",
        str(tmp_path / "exp"),
        "--lr",
        "0",
        "--max-steps",
        "1",
        "--export",
        str(tmp_path / "exp2"),
    ]
    assert main(common[:4] + common[6:] + tuned) == 0
    dr2 = DartDrafter.from_pretrained(tmp_path / "exp2", model, tokenizer=tok)
    assert dr2.config.draft_vocab_size == 2048
    assert torch.equal(dr2.draft_to_target, dr.draft_to_target)
    for (k, a), b in zip(dr.state_dict().items(), dr2.state_dict().values()):
        assert torch.equal(a, b), k
