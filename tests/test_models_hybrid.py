"""Hybrid targets (Gated DeltaNet + full attention: ``qwen3_next``, ``qwen3_5``) on tiny random
configs.

References: the Hugging Face forward (logits of every tree node = the HF logits after the
node's root path) and ``generate(do_sample=False)`` (greedy outputs equal, token for token,
through random / oracle trees, chains and the ``ar`` / ``suffix`` builders). And the states a
speculative decode commits after every round equal a plain autoregressive decode's at the
same position: rejected drafts leave nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dartcore import DartDecoder, rounds
from dartcore.errors import DartError, TreeError
from dartcore.models.hybrid import TREE_FORMS, HybridTarget, tree_parents
from dartcore.sampling import SamplingParams
from dartcore.tree import Tree, ancestor_mask
from dartcore.trees import register_tree_builder
from test_decoder import CharTokenizer, OracleBuilder, hf_greedy, random_tree

torch.set_num_threads(1)

LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny_next(
    seed: int = 0, *, experts: int = 0, layer_types=None, vocab: int = 64, family="qwen3_next"
):
    """A tiny random ``Qwen3NextForCausalLM`` (``family="qwen3_5"``: ``Qwen3_5ForCausalLM``,
    no MoE) with GQA in both the attention and the DeltaNet heads; weights sharpened as
    conftest.tiny_model does so greedy ties are unlikely."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    layer_types = layer_types or LAYERS
    moe = (
        dict(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
        if family == "qwen3_next"
        else {}
    )
    cfg = (Qwen3NextConfig if family == "qwen3_next" else Qwen3_5TextConfig)(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **moe,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # the 1-D ones are norms (1 + w), decays and biases
                p.mul_(4.0)
    return model.eval()


@dataclass
class ChainOracle(OracleBuilder):
    """Chains only: the reference continuation up to a random cut, then random tokens."""

    def __call__(self, inputs):
        ctx = [int(t) for t in inputs.context]
        assert ctx == self.reference[: len(ctx)]
        depth = min(self.depth, inputs.max_depth, inputs.budget())
        truth = self.reference[len(ctx) : len(ctx) + depth]
        cut = int(self.rng.integers(0, len(truth) + 1))
        path = truth[:cut] + self.rng.integers(3, self.vocab, size=depth - cut).tolist()
        n = len(path) + 1
        return Tree(
            np.asarray([ctx[-1], *path], dtype=np.int64),
            np.arange(-1, n - 1, dtype=np.int64),
            np.arange(n, dtype=np.int64),
        )


register_tree_builder("test-chain-oracle", lambda **kw: ChainOracle(**kw), replace=True)


FORMS = pytest.mark.parametrize("tree_form", TREE_FORMS)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@FORMS
def test_prompt_and_tree_logits_match_hf_forward(tree_form, family):
    model = tiny_next(1, family=family)
    target = HybridTarget(model, tree_form=tree_form)
    rng = np.random.default_rng(0)
    prompt = [1] + rng.integers(3, 64, size=9).tolist()
    with torch.no_grad():
        hf = model(torch.tensor([prompt])).logits[0]
    cache = target.new_cache(64)
    out = target.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)))
    torch.testing.assert_close(out.logits, hf, atol=1e-4, rtol=0)
    cache.commit(len(prompt))
    root = int(out.logits[-1].argmax())
    tree = random_tree(rng, root, 64, nodes=16, depth=5)
    pre = cache.length
    out = target.forward(
        cache,
        torch.from_numpy(tree.tokens),
        torch.from_numpy(tree.depths + pre),
        torch.from_numpy(ancestor_mask(tree.parents)),
    )
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        with torch.no_grad():
            want = model(torch.tensor([prompt + path[::-1]])).logits[0, -1]
        torch.testing.assert_close(out.logits[i], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "tree,params",
    [
        ("test-oracle", {"nodes": 12, "depth": 5, "max_nodes": 12}),
        ("test-oracle", {"nodes": 17, "depth": 6, "max_nodes": 16}),
        ("test-chain-oracle", {"depth": 6, "max_nodes": 6}),
    ],
)
@FORMS
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_greedy_matches_hf_generate_with_trees(tree, params, tree_form, family):
    tok = CharTokenizer()
    rng = np.random.default_rng(3)
    accepted = np.zeros(8, dtype=np.int64)
    for trial, seed in enumerate((0, 1, 2)):
        model = tiny_next(seed, family=family)
        model.generation_config.eos_token_id = None
        prompt = [1] + rng.integers(3, 64, size=int(rng.integers(1, 20))).tolist()
        ref = hf_greedy(model, prompt, 30)
        dec = DartDecoder(
            model, tok, tree=tree, reference=prompt + ref, vocab=64, seed=trial, **params
        )
        dec.eos_token_ids = ()
        dec.target.tree_form = tree_form
        res = dec.generate(prompt, max_new_tokens=30)
        assert res.tokens == ref
        hist = res.stats.accept_hist
        accepted[: len(hist)] += hist
    # rejected drafts, partly and wholly accepted ones all occurred
    assert accepted[0] > 0 and accepted[2:].sum() > 0


@pytest.mark.parametrize("tree", ["ar", "suffix"])
def test_builders_without_a_drafter_match_hf_generate(tree):
    model = tiny_next(4, experts=4)  # the MoE MLP
    model.generation_config.eos_token_id = None
    tok = CharTokenizer()
    # a repetitive prompt: the suffix chain matches
    prompt = [1] + [5, 9, 22, 7, 3, 40, 11] * 3
    ref = hf_greedy(model, prompt, 30)
    dec = DartDecoder(model, tok, tree=tree)
    dec.eos_token_ids = ()
    res = dec.generate(prompt, max_new_tokens=30)
    assert res.tokens == ref
    if tree == "ar":
        assert res.stats.tau == 1.0


def _states(cache):
    return cache.conv.clone(), cache.rec.clone()


def test_plain_decoding_states_equal_hf_cache_states():
    """The lean forward's committed conv and recurrent states after the prompt and after
    every plain step are Hugging Face's own (its cache, same layout)."""
    model = tiny_next(2, layer_types=["linear_attention", "full_attention", "linear_attention"])
    target = HybridTarget(model, tree_form="recurrent")
    prompt, new = [1, 7, 30, 12, 5, 44], 12
    cache = target.new_cache(len(prompt) + new + 1)
    out = target.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)))
    cache.commit(len(prompt))
    with torch.no_grad():
        hf = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(new + 1):
        past = hf.past_key_values
        for layer, slot in ((0, 0), (2, 1)):
            torch.testing.assert_close(cache.conv[slot], past.get_conv_state(layer)[0])
            torch.testing.assert_close(cache.rec[slot], past.get_recurrent_state(layer)[0])
        tok = int(out.logits[-1].argmax())
        assert tok == int(hf.logits[0, -1].argmax())
        out = target.forward(cache, torch.tensor([tok]), torch.tensor([cache.length]))
        cache.commit(1)
        with torch.no_grad():
            hf = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)


@FORMS
def test_rejected_drafts_leave_the_states_of_plain_decoding(tree_form):
    model = tiny_next(2, layer_types=["linear_attention", "full_attention", "linear_attention"])
    model.generation_config.eos_token_id = None
    tok = CharTokenizer()
    prompt = [1, 7, 30, 12, 5, 44]
    new = 30
    # plain AR steps through HF's own one-token functions: the committed states after every
    # position
    target = HybridTarget(model, tree_form="recurrent")
    cache = target.new_cache(len(prompt) + new)
    out = target.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)))
    cache.commit(len(prompt))
    seq, plain = list(prompt), {cache.length: _states(cache)}
    for _ in range(new):
        seq.append(int(out.logits[-1].argmax()))
        out = target.forward(cache, torch.tensor(seq[-1:]), torch.tensor([cache.length]))
        cache.commit(1)
        plain[cache.length] = _states(cache)
    assert seq[len(prompt) :] == hf_greedy(model, prompt, new)

    dec = DartDecoder(
        model,
        tok,
        tree="test-oracle",
        reference=seq,
        vocab=64,
        seed=5,
        nodes=14,
        depth=5,
        max_nodes=14,
    )
    dec.eos_token_ids = ()
    dec.target.tree_form = tree_form
    parts = dec.parts
    stats = rounds.GenerationStats()
    s = rounds.new_sequence(parts, prompt, new, SamplingParams().sampler(), (), stats)
    done = rounds.prefill(parts, s)
    checked = 0
    while not done:
        depth, _ = rounds.limits(parts, s)
        (drafted,) = rounds.draft(parts, [s], [depth])
        (tree,) = rounds.search(parts, [s], [drafted], [depth])
        (out,) = rounds.verify(parts, [s], [tree])
        done = rounds.accept(parts, s, tree, out)
        conv, rec = plain[s.cache.length]
        torch.testing.assert_close(s.cache.conv, conv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(s.cache.rec, rec, atol=1e-6, rtol=1e-6)
        checked += 1
    assert s.generated == seq[len(prompt) :]
    assert stats.accept_hist[0] > 0 and checked > 3  # rejections happened and were checked


def test_tree_parents_from_masks():
    parents = np.array([-1, 0, 0, 1, 2, 3])
    mask = torch.from_numpy(ancestor_mask(parents))
    assert tree_parents(mask, 6).tolist() == parents.tolist()
    assert tree_parents(None, 3).tolist() == [-1, 0, 1]
    bad = mask.clone()
    bad[3, 2] = True  # row 3 sees a row that is not its ancestor
    with pytest.raises(TreeError):
        tree_parents(bad, 6)


def test_truncate_restores_checkpointed_states_and_refuses_others():
    """A hybrid cache rewinds to a checkpointed length (or 0): its states are the ones that
    length had, and decoding from there gives the same tokens; any other length raises."""
    model = tiny_next(2, layer_types=["linear_attention", "full_attention", "linear_attention"])
    target = HybridTarget(model)
    prompt = [1, 7, 30, 12, 5, 44]
    cache = target.new_cache(64)

    def prefill():
        out = target.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)))
        cache.commit(len(prompt))
        return out

    def greedy(out, steps):
        toks = []
        for _ in range(steps):
            toks.append(int(out.logits[-1].argmax()))
            out = target.forward(cache, torch.tensor(toks[-1:]), torch.tensor([cache.length]))
            cache.commit(1)
        return toks, out

    prompt_out = out = prefill()
    assert cache.checkpoint() == len(prompt)
    at_prompt = _states(cache)
    first, out = greedy(out, 5)
    cache.checkpoint()
    at_11 = _states(cache)
    rest, _ = greedy(out, 4)
    assert cache.length == 15 and cache.kept_lengths == [0, 6, 11]
    with pytest.raises(DartError, match="no recurrent state kept at length 9"):
        cache.truncate(9)
    assert cache.length == 15  # a refused rewind changes nothing
    cache.truncate(11)
    torch.testing.assert_close(_states(cache), at_11, atol=0, rtol=0)
    cache.truncate(len(prompt))
    torch.testing.assert_close(_states(cache), at_prompt, atol=0, rtol=0)
    assert cache.kept_lengths == [0, 6]  # checkpoints past the new length are gone
    # the same continuation again from the restored states (the KV cache shortened alike)
    again, _ = greedy(prompt_out, 9)
    assert again == first + rest == hf_greedy(model, prompt, 9)
    cache.truncate(0)
    assert cache.length == 0 and not cache.conv.any() and not cache.rec.any()
    assert greedy(prefill(), 9)[0] == first + rest
    with pytest.raises(ValueError):
        cache.truncate(cache.length + 1)


def test_state_bytes_per_node_are_a_nodes_states():
    """state_bytes_per_node from a config dict: per Gated DeltaNet layer the bytes of one
    sequence's conv window and recurrent state as HybridCache holds them (a float32 model:
    4-byte windows), which the recurrent tree form stages once per node."""
    from dartcore.models.hybrid import state_bytes_per_node

    model = tiny_next(1)
    cache = HybridTarget(model).new_cache(64)
    b = state_bytes_per_node(model.config.to_dict(), conv_bytes=4, kv_bytes=4)
    conv, rec = cache.conv[0], cache.rec[0]
    assert b["conv_bytes_per_layer"] == conv.numel() * conv.element_size()
    assert b["recurrent_bytes_per_layer"] == rec.numel() * rec.element_size()
    assert b["linear_layers"] == cache.conv.shape[0] == 3 and b["full_attention_layers"] == 1
    assert b["state_bytes_per_node"] == 3 * b["state_bytes_per_layer"]
    k = cache.kv.k  # [layers, kv heads, capacity, head dim]: one position's keys and values
    assert b["kv_bytes_per_node"] == 2 * k[:, :, 0].numel() * k.element_size()
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "layer_types"}
    cfg["full_attention_interval"] = 2  # HF's default pattern when layer_types is absent
    assert state_bytes_per_node(cfg)["linear_layers"] == 2
    with pytest.raises(DartError, match="linear_num_value_heads"):
        state_bytes_per_node({k: v for k, v in cfg.items() if k != "linear_num_value_heads"})


def test_teacher_runs_each_packed_document_from_zero_states():
    """Training's teacher forward on a hybrid target: each document of a packed row gives the
    taps and logits of that document alone (its DeltaNet states start from zero)."""
    from dartcore.training.data import PackedSequence
    from dartcore.training.trainer import make_batch, teacher_forward

    model = tiny_next(3)
    torch.manual_seed(0)
    a, b = torch.randint(3, 64, (9,)), torch.randint(3, 64, (7,))
    ids = torch.cat((a, b)).numpy()
    doc = np.r_[np.zeros(9), np.ones(7)].astype(np.int64)
    pos = np.r_[np.arange(9), np.arange(7)]
    end = np.r_[np.full(9, 8), np.full(7, 15)]
    batch = make_batch([PackedSequence(ids, pos, doc, np.ones(16, bool), end)])
    taps, logits = teacher_forward(model, batch, (1, 2, 4))
    for lo, hi, part in ((0, 9, a), (9, 16, b)):
        with torch.no_grad():
            alone = model(part[None], output_hidden_states=True)
        torch.testing.assert_close(logits[0, lo:hi], alone.logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            taps[0, lo:hi, 32:64], alone.hidden_states[2][0], atol=1e-4, rtol=1e-4
        )
    cols = torch.tensor([0, 5, 63])
    _, sub = teacher_forward(model, batch, (1, 2, 4), cols)
    torch.testing.assert_close(sub, logits[..., cols], atol=1e-5, rtol=1e-5)


def test_a_training_step_on_a_hybrid_target_changes_the_drafter(tmp_path):
    """One Trainer step of a DART drafter on a tiny qwen3_next target: finite loss, and every
    trained parameter group moves."""
    from dartcore.drafter import DartDrafter
    from dartcore.training.data import pack_documents
    from dartcore.training.trainer import TrainConfig, Trainer

    model = tiny_next(4, layer_types=LAYERS + ["linear_attention", "full_attention"])
    torch.manual_seed(0)
    drafter = DartDrafter.from_target(model, d=3)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    cfg = TrainConfig(
        ctx_len=24,
        batch_size=2,
        anchors_per_seq=6,
        d=3,
        lr=3e-3,
        warmup_steps=0,
        max_steps=1,
        eval_every=0,
        checkpoint_every_minutes=1e9,
    )
    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, 64, size=n), np.arange(n) >= 2) for n in (9, 12, 7, 13)]
    seqs = pack_documents(docs, 24)
    Trainer(drafter, model, seqs, cfg, tmp_path, progress=False).run()
    import json

    (rec,) = [json.loads(line) for line in open(tmp_path / "log.jsonl") if '"loss"' in line]
    assert np.isfinite(rec["loss"]) and rec["loss"] > 0
    trained = [k for k, p in drafter.named_parameters() if p.requires_grad]
    moved = [k for k in trained if not torch.equal(drafter.state_dict()[k], before[k])]
    assert trained and moved == trained


def test_dart_train_cli_runs_a_step_on_a_hybrid_target(tmp_path):
    """``dart-train`` on a saved tiny qwen3_next model directory: one step, a finite loss, an
    exported drafter that loads on the hybrid target."""
    import json

    from cli_helpers import run_cli, save_tiny_target, write_text_corpus
    from dartcore.drafter import DartDrafter

    model = tiny_next(4, layer_types=LAYERS + ["linear_attention", "full_attention"])
    target = save_tiny_target(tmp_path / "target", model)
    corpus = write_text_corpus(tmp_path / "corpus", docs=12)
    out = tmp_path / "run"
    proc = run_cli(
        "dart_train",
        *("--target", target, "--data", corpus, "--out", out, "--holdout", "2"),
        *("--ctx-len", "64", "--batch-size", "2", "--anchors", "8", "--d", "3"),
        *("--warmup", "0", "--max-steps", "1", "--eval-every", "0", "--eval-docs", "2"),
        *("--device", "cpu", "--threads", "1", "--no-progress"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in open(out / "log.jsonl") if '"loss"' in line]
    assert len(steps) == 1 and np.isfinite(steps[0]["loss"])
    back = DartDrafter.from_pretrained(out / "drafter", model)
    assert back.config.d == 3 and back.taps == DartDrafter.from_target(model, d=3).taps


@pytest.fixture(scope="module")
def drafted_setup(tmp_path_factory):
    """A tiny hybrid target, an untrained DartDrafter for it and an n-gram index that has
    seen the reference continuations of half the prompts."""
    from dartcore.drafter import DartDrafter
    from dartcore.index import NgramIndex, build_index

    model = tiny_next(5, layer_types=LAYERS + ["linear_attention", "full_attention"])
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(3, 64, size=int(rng.integers(3, 12))).tolist() for _ in range(4)]
    refs = [hf_greedy(model, p, 24) for p in prompts]
    docs = [np.array(p + r, dtype=np.int64) for p, r in list(zip(prompts, refs))[:2]]
    docs += [rng.integers(0, 64, size=200) for _ in range(20)]
    path = tmp_path_factory.mktemp("idx") / "tiny.idx"
    build_index(docs, path, vocab_size=64)
    drafter = DartDrafter.from_target(model, d=4)
    return model, drafter, NgramIndex(path), prompts, refs


@pytest.mark.parametrize("tree", ["dart", "dart-no-ngram", "dart-chain", "ngram-only", None])
def test_drafter_and_index_builders_match_hf_generate(drafted_setup, tree):
    """Every builder that reads the drafter or the index; None: the CPU's default
    (``dart+live``, its judge choosing each round's kind)."""
    model, drafter, index, prompts, refs = drafted_setup
    params = {} if tree == "dart-chain" else {"max_nodes": 8}
    with pytest.warns(UserWarning, match="tokenizer"):  # the bare index names no tokenizer
        dec = DartDecoder(
            model, CharTokenizer(), drafter, index, tree=tree, eos_token_ids=(), **params
        )
    taus = []
    for prompt, ref in zip(prompts, refs):
        res = dec.generate(prompt, max_new_tokens=24)
        assert res.tokens == ref
        taus.append(res.stats.tau)
    if tree in ("dart", "ngram-only"):
        assert max(taus) > 1.3  # the index knows two continuations: whole paths accepted


def test_batched_engine_on_a_hybrid_target_matches_hf_generate():
    from dartcore.engine import Engine
    from dartcore.sampling import SamplingParams
    from test_engine import oracle_decoder, prompts_and_refs, run

    model = tiny_next(6)
    model.generation_config.eos_token_id = None
    prompts, refs = prompts_and_refs(model, 4, 24, seed=2, lengths=[1, 40, 7, 19])
    # three slots for four requests: one joins when another leaves (its slot's states reset)
    engine = Engine(oracle_decoder(model, prompts, refs), max_batch=3, budget=6)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    seen = run(engine)
    hist = np.zeros(8, dtype=np.int64)
    for rid, ref in zip(ids, refs):
        last = seen[rid][-1]
        assert last.finished and last.tokens == ref
        acc = last.stats["accept_hist"]
        hist[: len(acc)] += acc
    assert hist[0] > 0 and hist[2:].sum() > 0


def test_sampled_distribution_matches_the_hybrid_target():
    """Tree verification samples the target's own distribution (the chi-square test of
    test_decoder_sampling.py on an 8-token hybrid model), and token for token as AR sampling
    with the same seed almost always."""
    from test_decoder_sampling import ALPHA, chi_square_p, exact_joint, sample_counts

    model = tiny_next(1, vocab=8)
    exact = exact_joint(model, 1.0, 0, 1.0)
    dart = DartDecoder(model, CharTokenizer(), tree="test-random-small", eos_token_ids=())
    n = 800
    counts, dart_out, tau = sample_counts(dart, range(n), temperature=1.0)
    assert tau > 1.1
    assert chi_square_p(counts, exact) > ALPHA
    ar = DartDecoder(model, CharTokenizer(), tree="ar", eos_token_ids=())
    _, ar_out, _ = sample_counts(ar, range(n), temperature=1.0)
    assert sum(a == b for a, b in zip(dart_out, ar_out)) >= 0.99 * n


def test_generate_batch_with_a_drafter_and_adaptive_budgets(drafted_setup, monkeypatch, tmp_path):
    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path))  # the measured verify-cost curve
    model, drafter, _index, prompts, refs = drafted_setup
    dec = DartDecoder(model, CharTokenizer(), drafter, tree="dart-no-ngram", eos_token_ids=())
    for budget in ("adaptive", 4):
        batch = dec.generate_batch(prompts, max_new_tokens=24, budget=budget)
        assert [r.tokens for r in batch] == refs


@pytest.mark.parametrize("native_products", [False, True])
def test_products_on_either_kernel_match_hf_generate(native_products):
    from dartcore.kernels.linear import native_linear_available

    if native_products and not native_linear_available():
        pytest.skip("the native kernel does not run here")
    model = tiny_next(7)
    prompt = [1, 9, 4, 33, 21]
    ref = hf_greedy(model, prompt, 24)
    target = HybridTarget(model, native_products=native_products)
    assert target.native_products == native_products
    assert target.greedy_generate(prompt, 24) == ref
