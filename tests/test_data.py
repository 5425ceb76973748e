"""The input pipelines (train.data): MQAR as Zoology, tokenizers, files, packing, grain resume."""

import dataclasses
import itertools
import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import precond_linattn as pla
from conftest import rel_err
from train.data import (IGNORE_INDEX, BPETokenizer, ByteTokenizer, DataSpec, MQARTask, TextTask,
                        build_dataset, flatten_cu_seqlens, make_task, row_cu_seqlens)
from train.data.mqar import query_gap_probs
from train.data.packing import Tokenize, pack_documents
from train.data.sources import TextFiles, TinyCorpus
from train.data.vocab import encode_document

MQAR_KEYS = ("inputs", "targets")
KEYS = (*MQAR_KEYS, "segment_ids", "positions", "cu_seqlens")  # the packed tasks'


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) and sorted(x) in (sorted(KEYS), sorted(MQAR_KEYS))
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# ---------------------------------------------------------------- MQAR


@pytest.mark.parametrize("random_non_queries", [True, False])
@pytest.mark.parametrize("num_passes", [1, 2])
def test_mqar_structure(random_non_queries, num_passes):
    task = MQARTask(vocab_size=512, seq_len=128, num_kv_pairs=8, num_passes=num_passes,
                    random_non_queries=random_non_queries)
    V, n, C = 512, 8, 16 * num_passes
    for i in range(200):
        ex = task.example(7, i)
        x, y = ex["inputs"], ex["targets"]
        assert x.shape == y.shape == (128,) and x.dtype == y.dtype == np.int32
        keys, values = x[0:C:2], x[1:C:2]
        np.testing.assert_array_equal(keys, np.tile(keys[:n], num_passes))
        np.testing.assert_array_equal(values, np.tile(values[:n], num_passes))
        keys, values = keys[:n], values[:n]
        assert np.all((1 <= keys) & (keys < V // 2)) and len(set(keys)) == n
        assert np.all((V // 2 <= values) & (values < V)) and len(set(values)) == n
        query = np.flatnonzero(y != IGNORE_INDEX)
        assert len(query) == n and query.min() >= C and np.all((query - C) % 2 == 0)
        bound = dict(zip(keys, values))
        assert sorted(x[query]) == sorted(keys)  # every key queried once
        assert all(y[q] == bound[x[q]] for q in query)
        filler = np.ones(128, bool)
        filler[:C] = filler[query] = False
        if random_non_queries:
            assert len(np.unique(x[filler])) > 20 and x.max() < V and x.min() >= 0
        else:
            assert np.all(x[filler] == 0)


def test_mqar_determinism():
    task = MQARTask(vocab_size=256, seq_len=64, num_kv_pairs=4)
    a, b = task.example(3, 11), task.example(3, 11)
    for k in ("inputs", "targets"):
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs"], task.example(3, 12)["inputs"])
    assert not np.array_equal(a["inputs"], task.example(4, 11)["inputs"])


def test_mqar_power_law():
    """One pair: the query gap is one draw of Zoology's law p(g) ∝ a (g + 1)^(a − 1)."""
    task = MQARTask(vocab_size=128, seq_len=64, num_kv_pairs=1, power_a=0.01)
    gaps = np.array([(np.flatnonzero(task.example(0, i)["targets"] != IGNORE_INDEX)[0] - 2) // 2
                     for i in range(4000)])
    p = query_gap_probs(31, 0.01)
    empirical = np.bincount(gaps, minlength=31) / len(gaps)
    assert np.abs(np.cumsum(empirical) - np.cumsum(p)).max() < 0.03  # KS; 5% critical value 0.021
    assert empirical[0] > 0.15 and empirical[:8].sum() > 0.5 > empirical[16:].sum()


def test_mqar_validation():
    with pytest.raises(ValueError, match="even"):
        MQARTask(seq_len=63)
    with pytest.raises(ValueError, match="exceed seq_len"):
        MQARTask(vocab_size=64, seq_len=64)
    with pytest.raises(ValueError, match="2·num_kv_pairs"):
        MQARTask(seq_len=64, num_kv_pairs=17)


def test_mqar_pipeline_rows_are_examples():
    spec = DataSpec(task="mqar", params=dict(vocab_size=256, seq_len=64, num_kv_pairs=4), batch_size=4,
                    seed=5, shuffle=False)
    task, batches = make_task(spec), take(iter(build_dataset(spec)), 2)
    for i, row in enumerate(itertools.chain(*(zip(b["inputs"], b["targets"]) for b in batches))):
        ex = task.example(5, i)
        np.testing.assert_array_equal(row[0], ex["inputs"])
        np.testing.assert_array_equal(row[1], ex["targets"])
    assert all(sorted(b) == sorted(MQAR_KEYS) and all(v.dtype == np.int32 for v in b.values())
               for b in batches)  # one example per row: no document boundaries


# ---------------------------------------------------------------- tokenizers and sources


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Hello, wörld! ✓ 数据\n\ttab"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256 and tok.decode(ids) == text
    doc = encode_document(tok, text)
    assert doc[0] == tok.bos_id == 257 and doc[-1] == tok.eos_id == 258 and tok.pad_id == 256
    assert tok.vocab_size == 259 and tok.decode(doc) == text


def test_bpe_tokenizer_from_local_file(tmp_path):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TinyCorpus(200)[i] for i in range(200)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    task = TextTask(paths=str(tmp_path / "*.json"), tokenizer_name="bpe",
                    vocab_file=str(tmp_path / "tokenizer.json"))
    tok = task.tokenizer
    assert isinstance(tok, BPETokenizer) and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "the code of mira is 4172. what is the code of mira?"
    ids = tok.encode(text)
    assert len(ids) < len(text) / 2 and tok.decode(encode_document(tok, text)) == text
    assert task.vocab_size == 400
    with pytest.raises(ValueError, match="not in the vocabulary"):
        BPETokenizer(str(tmp_path / "tokenizer.json"), bos_token="<bos>").bos_id
    with pytest.raises(ValueError, match="vocab_file"):
        TextTask(paths="x", tokenizer_name="bpe")


def test_text_files(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n\nstill second\n")
    (tmp_path / "a.txt").write_text("first file")
    (tmp_path / "p.md").write_text("\n\npara one\nline two\n  \n\npara two\n\n\n  para three  \n")
    (tmp_path / "d.jsonl").write_text('{"text": "doc one", "id": 1}\n\n{"id": 2, "text": "doc\\ntwo ✓"}\n'
                                      '{"body": "x", "text": "doc three"}\n')
    (tmp_path / "bad.jsonl").write_text('{"body": "no text"}\n')
    files = TextFiles([str(tmp_path / "*.txt")])
    assert [files[i] for i in range(len(files))] == ["first file", "second file\n\nstill second\n"]
    paras = TextFiles([str(tmp_path / "p.md")], unit="paragraph")
    assert [paras[i] for i in range(len(paras))] == ["para one\nline two", "para two", "para three"]
    docs = TextFiles([str(tmp_path / "d.jsonl")], "jsonl")
    assert [docs[i] for i in range(len(docs))] == ["doc one", "doc\ntwo ✓", "doc three"]
    assert TextFiles([str(tmp_path / "d.jsonl")], "jsonl", text_field="body")[2] == "x"
    with pytest.raises(ValueError, match="no string field 'text'"):
        TextFiles([str(tmp_path / "bad.jsonl")], "jsonl")[0]
    with pytest.raises(ValueError, match="no files match"):
        TextFiles([str(tmp_path / "*.none")])


# ---------------------------------------------------------------- packing and boundaries


def check_rows(rows, docs, T, max_docs, max_doc_len, pad_id):
    """Layout of packed rows, and the documents' pairs preserved in order."""
    pieces = []
    for row in rows:
        x, y, seg, pos = row["inputs"], row["targets"], row["segment_ids"], row["positions"]
        assert x.shape == y.shape == seg.shape == pos.shape == (T,)
        n = seg.max()
        assert 1 <= n <= max_docs
        used = seg > 0
        assert np.all(seg[used] == np.sort(seg[used])) and set(seg[used]) == set(range(1, n + 1))
        assert np.all(used[: used.sum()])  # padding only at the end
        assert np.all(x[~used] == pad_id) and np.all(y[~used] == IGNORE_INDEX) and np.all(pos[~used] == 0)
        for s in range(1, n + 1):
            idx = np.flatnonzero(seg == s)
            assert len(idx) <= max_doc_len
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
            pieces.append((x[idx], y[idx]))
    ids = [encode_document(ByteTokenizer(), d) for d in docs]
    for j, pairs in ((0, [d[:-1] for d in ids]), (1, [d[1:] for d in ids])):
        np.testing.assert_array_equal(np.concatenate([p[j] for p in pieces]), np.concatenate(pairs))


@pytest.mark.parametrize("T,max_docs,max_doc_len", [(32, 3, 32), (48, 8, 20), (16, 1, 16)])
def test_packing(T, max_docs, max_doc_len):
    rng = np.random.default_rng(T)
    docs = ["".join(chr(97 + c) for c in rng.integers(0, 26, n)) for n in rng.integers(0, 70, 60)]
    tok = ByteTokenizer()
    ds = grain.MapDataset.source(docs).map(Tokenize(tok)).to_iter_dataset()
    rows = list(pack_documents(ds, seq_len=T, max_docs_per_row=max_docs, max_doc_len=max_doc_len,
                               pad_id=tok.pad_id))
    check_rows(rows, docs, T, max_docs, max_doc_len, tok.pad_id)


def test_text_pipeline_layout(tmp_path):
    """JSONL file -> rows (one epoch, in order, one row per batch so none is dropped)."""
    docs = [TinyCorpus(50, seed=1)[i] for i in range(50)]
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    spec = DataSpec(task="text", params=dict(paths=(str(tmp_path / "c.jsonl"),), format="jsonl",
                                             seq_len=96, max_docs_per_row=3, max_doc_len=64),
                    batch_size=1, shuffle=False, num_epochs=1)
    batches = list(build_dataset(spec))
    for b in batches:
        assert sorted(b) == sorted(KEYS) and all(v.dtype == np.int32 for v in b.values())
        np.testing.assert_array_equal(b["cu_seqlens"], row_cu_seqlens(b["segment_ids"], 4))
    check_rows([{k: b[k][0] for k in KEYS} for b in batches], docs, 96, 3, 64, ByteTokenizer().pad_id)


def test_cu_seqlens_forms():
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    cu = row_cu_seqlens(seg, 5)
    np.testing.assert_array_equal(cu, [[0, 3, 5, 6, 8, 8], [0, 8, 8, 8, 8, 8]])
    np.testing.assert_array_equal(flatten_cu_seqlens(cu, 8), [0, 3, 5, 6, 8, 8, 16, 16, 16, 16, 16])
    with pytest.raises(ValueError, match="at most 3 fit"):
        row_cu_seqlens(seg, 3)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_padded_cu_seqlens_reset_states_in_the_op(rand, impl):
    """A packed batch's flattened cu_seqlens (with empty documents) == its exact offsets, under jit."""
    spec = DataSpec(task="tiny_text", params=dict(seq_len=48, max_docs_per_row=4), batch_size=2)
    cu = flatten_cu_seqlens(next(iter(build_dataset(spec)))["cu_seqlens"], 48)
    exact = jnp.asarray(np.unique(np.asarray(cu)), jnp.int32)
    assert len(exact) < len(cu)
    x = rand.delta_inputs(1, 96, 2, 8, 8)
    run = jax.jit(lambda c: pla.delta_rule(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=c, impl=impl,
                                           chunk_size=16)[0])
    assert rel_err(run(cu), run(exact)) <= 1e-6
    assert rel_err(run(exact), run(jnp.asarray([0, 96], jnp.int32))) > 1e-2  # the resets matter


# ---------------------------------------------------------------- grain: determinism, resume, hosts

SPECS = {
    "mqar": DataSpec(task="mqar", params=dict(vocab_size=128, seq_len=32, num_kv_pairs=4, num_examples=40),
                     batch_size=4, seed=1),
    "tiny_text": DataSpec(task="tiny_text", params=dict(seq_len=64, max_docs_per_row=4, num_documents=5),
                          batch_size=2, seed=2),
}


def text_spec(tmp_path):
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("\n\n".join(TinyCorpus(2, seed=i)[j] for j in range(2)))
    return DataSpec(task="text", params=dict(paths=(str(tmp_path / "*.txt"),), unit="paragraph", seq_len=64,
                                             max_docs_per_row=4, max_doc_len=40), batch_size=4, seed=3)


@pytest.fixture(params=["mqar", "tiny_text", "text"])
def spec(request, tmp_path):
    return text_spec(tmp_path) if request.param == "text" else SPECS[request.param]


def test_iterator_determinism(spec):
    a, b = take(iter(build_dataset(spec)), 12), take(iter(build_dataset(spec)), 12)
    assert_same_batches(a, b)
    other = take(iter(build_dataset(dataclasses.replace(spec, seed=spec.seed + 1))), 12)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, other))


@pytest.mark.parametrize("n", [0, 5, 13])
def test_checkpoint_resume(spec, n):
    """State after n batches (through JSON), restored in a fresh iterator: the same next batches.
    Every spec has at most 11 batches per epoch, so the 12 + n batches cross epochs."""
    it = iter(build_dataset(spec))
    take(it, n)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 12)
    resumed = iter(build_dataset(spec))
    resumed.set_state(state)
    assert_same_batches(take(resumed, 12), expected)


def test_host_sharding():
    """Two processes read disjoint halves of the examples; together, every example once per epoch."""
    spec = DataSpec(task="mqar", params=dict(vocab_size=128, seq_len=32, num_kv_pairs=4, num_examples=24),
                    batch_size=4, num_epochs=1)
    task = make_task(spec)
    ids = {tuple(task.example(spec.seed, i)["inputs"]): i for i in range(24)}
    seen = []
    for p in range(2):
        batches = list(build_dataset(spec, process_index=p, process_count=2))
        assert len(batches) == 6 and all(b["inputs"].shape == (2, 32) for b in batches)
        seen.append({ids[tuple(r)] for b in batches for r in b["inputs"]})
    assert seen[0] == set(range(0, 24, 2)) and seen[1] == set(range(1, 24, 2))
    with pytest.raises(ValueError, match="multiple of process_count=3"):
        build_dataset(spec, process_index=0, process_count=3)


def test_spec_errors():
    with pytest.raises(ValueError, match="unknown data task 'nope'"):
        make_task(DataSpec(task="nope"))
    with pytest.raises(ValueError, match=r"unknown params \['seqlen'\].*'seq_len'"):
        make_task(DataSpec(task="mqar", params=dict(seqlen=64)))


@pytest.mark.parametrize("name", ["mqar", "tiny_text"])
def test_multiprocessing_prefetch(name):
    """Two worker processes: a deterministic stream that resumes exactly from its state; for the
    map-only MQAR pipeline it is the in-process stream itself."""
    spec = dataclasses.replace(SPECS[name], worker_count=2)
    it = iter(build_dataset(spec))
    first = take(it, 6)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 6)
    it.close()
    resumed = iter(build_dataset(spec))
    resumed.set_state(state)
    assert_same_batches(take(resumed, 6), expected)
    resumed.close()
    if name == "mqar":
        assert_same_batches(first + expected, take(iter(build_dataset(SPECS[name])), 12))
