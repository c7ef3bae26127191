"""The native runner's token embedding read by row from a GGUF file (models/embedding.py): the
rows are bitwise the dense table's, for every block type real files use for token_embd, and a
runner loaded from a file holds no float32 [V, H] table (nor does its tied head)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from specdecode.bench.shapes import SHAPES, Shape, add_hyperparameters, random_blocks, write_shape
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.models.embedding import DenseRows, FileRows
from specdecode.models.gguf_reader import GGUFFile
from specdecode.models.llama import LlamaRunner
from specdecode.models.weights import FileTensors, as_float

EMBED = "model.embed_tokens.weight"
#: token_embd's types in the files people run (Q4_K_M, Q5_0 + Q8_0, Q4_0/Q4_1, Q6_K, Q8_0 ...)
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "F16", "F32")
PROMPT = [1, 5, 9, 200, 300, 41, 7, 88, 5, 9, 200]


def table_file(path, qtype: str, rows: int = 300, cols: int = 512):
    """A GGUF file holding a token_embd of ``qtype`` [rows, cols] (random, valid blocks) and a
    final norm: all GGUFFile needs to read the table."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    add_hyperparameters(writer, Shape("llama", 1, cols, 1024, 4, 2, vocab=rows), 1e-5)
    rng = np.random.default_rng(0)
    if qtype in ("F16", "F32"):
        dtype = {"F16": np.float16, "F32": np.float32}[qtype]
        writer.add_tensor("token_embd.weight", (rng.standard_normal((rows, cols)) * 0.02).astype(dtype))
    else:
        writer.add_tensor("token_embd.weight", random_blocks(qtype, rows, cols, rng),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.add_tensor("output_norm.weight", np.ones(cols, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("blocks", [True, False], ids=["int4-int8", "fp32-bf16"])
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_the_dense_tables_rows_bitwise(tmp_path, qtype, blocks):
    file = GGUFFile(table_file(tmp_path / f"{qtype}.gguf", qtype))
    assert file.entries[EMBED].qtype == qtype
    dense = as_float(FileTensors(file, blocks)[EMBED])  # the table the runner held before
    table = FileRows(file, EMBED, blocks)
    assert table.shape == tuple(dense.shape) and table.nbytes == 0
    for tokens in ([0], [299], [5, 5, 17, 3, 299, 0, 17], list(range(300)), torch.tensor([[4, 2]])):
        rows = table.rows(tokens)
        want = dense[torch.as_tensor(tokens).reshape(-1)]
        assert rows.dtype == torch.float32 and torch.equal(rows.view(torch.int32), want.view(torch.int32))
    assert torch.equal(table.dense().view(torch.int32), dense.view(torch.int32))


def test_a_token_outside_the_vocabulary_is_refused(tmp_path):
    table = FileRows(GGUFFile(table_file(tmp_path / "t.gguf", "Q8_0")), EMBED, True)
    for bad in (300, -1):
        with pytest.raises(SpecDecodeError, match=rf"token id {bad} is outside the vocabulary \(0..299\)"):
            table.rows([3, bad])


def test_a_file_cut_short_after_loading_is_reported(tmp_path):
    path = table_file(tmp_path / "t.gguf", "Q8_0")
    table = FileRows(GGUFFile(path), EMBED, True)
    with open(path, "r+b") as f:
        f.truncate(GGUFFile(path).entries[EMBED].offset + 10)
    with pytest.raises(SpecDecodeError, match="cut short"):
        table.rows([200])


def float_tables(obj, vocab: int, hidden: int, seen=None) -> list[str]:
    """Attributes (recursively, through plain objects, lists and dicts) holding a float32
    tensor of vocab x hidden elements."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return ["tensor"] if obj.dtype == torch.float32 and obj.numel() >= vocab * hidden else []
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple))
             else vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, type) else ())
    return [f"{k}.{path}" for k, v in items if not isinstance(v, (GGUFFile, FileTensors))
            for path in float_tables(v, vocab, hidden, seen)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embedding")
    tied = replace(SHAPES["tiny"], tied=True)
    return {"Q4_K_M": write_shape(folder / "q4km.gguf", "tiny", "Q4_K_M", vocab=512),
            "Q4_1": write_shape(folder / "q41.gguf", "tiny-qwen2", "Q4_1", vocab=512),
            "Q4_0 gemma": write_shape(folder / "gemma.gguf", "tiny-gemma3", "Q4_0", vocab=512),
            "Q8_0 tied": write_shape(folder / "tied.gguf", tied, "Q8_0", vocab=512)}


@pytest.mark.parametrize("weights", ["int4", "int8", "fp32"])
@pytest.mark.parametrize("name", ["Q4_K_M", "Q4_1", "Q4_0 gemma", "Q8_0 tied"])
def test_a_runner_from_a_file_holds_no_float_table_and_computes_the_same(files, name, weights):
    runner = LlamaRunner.from_gguf(files[name], weights)
    s = runner.shape
    assert isinstance(runner.embed, FileRows) and runner.embed.nbytes == 0
    if weights != "fp32":  # fp32's layers are float32 weights by definition (a tied head too)
        assert float_tables(runner, s.vocab_size, s.hidden_size) == []
    # the runner as it was: the dense table of the same values, held
    dense = as_float(FileTensors(GGUFFile(files[name]), weights != "fp32")[EMBED])
    before = LlamaRunner.from_gguf(files[name], weights)
    before.embed = DenseRows(dense)
    assert torch.equal(runner.tables.input_embeddings(), dense)
    sample = dense[:: max(1, dense.shape[0] // 64), :8].double().sum().item()
    assert runner.fingerprint() == before.fingerprint() and f"{sample:.6e}" in runner.fingerprint()
    draft = Draft((7, 7, 300, 5), (-1, 0, -1, 2))
    for r in (runner, before):
        r.prefill(PROMPT)
    assert torch.equal(runner.forward(9, draft).logits, before.forward(9, draft).logits)
    assert torch.equal(runner.layer_loop.embed([3, 511, 3]), before.layer_loop.embed([3, 511, 3]))


def test_tensors_in_memory_keep_their_table(tiny_model):
    runner = LlamaRunner.from_transformers(tiny_model, "fp32")
    table = tiny_model.get_input_embeddings().weight
    assert isinstance(runner.embed, DenseRows)
    assert runner.embed.dense().data_ptr() == table.data_ptr()  # the model's own, not a copy
    assert torch.equal(runner.embed.rows([2, 0, 2]), table.detach()[[2, 0, 2]])
