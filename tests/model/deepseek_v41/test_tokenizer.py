"""V4.1 vocabulary, the patched cache file, deepseek-recipe encoding and the Engram token map."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from model.deepseek_v41 import tokenizer as T


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("shinkai-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHINKAI_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def v41(cache_dir):
    return T.load_v41_tokenizer()


def toy_tokenizer(vocab_size: int = 256) -> Tokenizer:
    """The oracle script's toy WordLevel vocabulary (reference/oracle/run_oracle.py build_tokenizer)."""
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    words = [
        "the",
        "The",
        "THE",
        " the",
        "cat",
        "Cat",
        "café",
        "cafe",
        "sat",
        " sat",
        "on",
        "On",
        "mat",
        "Mat",
        " ",
        "  ",
        "\n",
        "\t",
        "a",
        "A",
        "dog",
        "naïve",
        "naive",
        "Ｈello",
        "hello",
    ]
    vocab: dict[str, int] = {}
    for tok in specials + words:
        vocab.setdefault(tok, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<｜▁pad▁｜>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_v41_vocabulary_and_system_token(v41):
    assert v41.get_vocab_size(with_added_tokens=True) == T.V41_VOCAB_SIZE == 129280
    assert v41.id_to_token(128799) == "<｜System｜>"
    assert v41.token_to_id(T.V4_PLACEHOLDER_799) is None
    assert [v41.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜image｜>")] == [
        128803,
        128804,
        128821,
        128822,
        129279,
    ]
    assert v41.encode("<｜System｜>", add_special_tokens=False).ids == [128799]


def test_patched_file_lives_in_the_cache_and_is_written_once(cache_dir):
    path = T.v41_tokenizer_path()
    assert cache_dir in path.parents and path.name == "tokenizer.json"
    mtime = path.stat().st_mtime_ns
    assert T.v41_tokenizer_path() == path and path.stat().st_mtime_ns == mtime
    assert not [p for p in path.parent.iterdir() if p.name != "tokenizer.json"]  # no temp files left
    document = json.loads(path.read_text())
    original = json.loads(T.v4_tokenizer_json_path().read_text())
    changed = [(a, b) for a, b in zip(original["added_tokens"], document["added_tokens"]) if a != b]
    assert [(a["id"], a["content"], b["content"]) for a, b in changed] == [
        (128799, T.V4_PLACEHOLDER_799, T.V41_SYSTEM_TOKEN)
    ]
    assert {k: v for k, v in document.items() if k != "added_tokens"} == {
        k: v for k, v in original.items() if k != "added_tokens"
    }


def test_patch_rejects_an_unexpected_vocabulary():
    with pytest.raises(ValueError, match="128799"):
        T.patch_v41_tokenizer_json({"added_tokens": [{"id": 128799, "content": "<｜something｜>"}]})
    with pytest.raises(ValueError, match="expected 1"):
        T.patch_v41_tokenizer_json({"added_tokens": []})


def test_deepseek_recipe_encodes_with_the_patched_file(cache_dir):
    recipe = pytest.importorskip("deepseek_recipe")
    body = {
        "model": "DeepSeek-V4.1-Flash",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    }
    conversation = recipe.ChatCompletionRequest(json.dumps(body)).convert(recipe.ConversionOptions()).conversation
    ids = (
        recipe.DeepseekV41Encoding()
        .with_tokenizer(recipe.Tokenizer.from_file(str(T.v41_tokenizer_path())))
        .encode(conversation)
    )
    assert ids[:2] == [0, 128799]
    assert ids[-4:] == [128803, 19923, 128804, 128821]
    # The unpatched V4 vocabulary cannot render V4.1 prompts: the patch is what makes this work.
    with pytest.raises(Exception, match="System"):
        recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(T.v4_tokenizer_json_path()))).encode(
            conversation
        )


def test_engram_map_of_the_v41_vocabulary(v41):
    token_map, num_compressed = T.engram_token_map(v41)
    assert token_map.dtype == torch.long and token_map.shape == (129280,)
    assert num_compressed == T.V41_ENGRAM_COMPRESSED_VOCAB_SIZE == 99092
    # Ids are numbered by first appearance: each new id is one more than every id before it.
    running_max = torch.cummax(token_map, 0).values
    assert torch.equal(running_max[1:] - running_max[:-1] <= 1, torch.ones(129279, dtype=torch.bool))
    assert int(token_map.max()) + 1 == num_compressed
    hello, hello_cap = v41.token_to_id("hello"), v41.token_to_id("Hello")
    assert token_map[hello] == token_map[hello_cap]


def test_engram_map_rule_on_the_toy_tokenizer():
    tok = toy_tokenizer()
    token_map, num_compressed = T.engram_token_map(tok)
    assert num_compressed == 242  # spec §5.3: 256 ids → 242
    ids = tok.get_vocab()
    same = [
        ("the", "The", "THE", " the"),
        ("café", "cafe"),
        ("naïve", "naive"),
        ("Ｈello", "hello"),
        (" ", "  ", "\n", "\t"),
    ]
    for group in same:
        assert len({int(token_map[ids[t]]) for t in group}) == 1, group
    assert token_map[ids["cat"]] != token_map[ids["sat"]]


@pytest.mark.parametrize("which", ["toy", "v41"])
def test_engram_map_equals_nemo(which, cache_dir):
    engram = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.engram")
    from transformers import PreTrainedTokenizerFast

    if which == "toy":
        fast = PreTrainedTokenizerFast(
            tokenizer_object=toy_tokenizer(),
            bos_token="<｜begin▁of▁sentence｜>",
            eos_token="<｜end▁of▁sentence｜>",
            pad_token="<｜▁pad▁｜>",
        )
    else:
        fast = PreTrainedTokenizerFast(tokenizer_file=str(T.v41_tokenizer_path()))
    theirs, num_theirs = engram._compressed_token_map(fast)
    ours, num_ours = T.engram_token_map(fast)
    assert num_ours == num_theirs
    assert ours.tolist() == list(theirs)


def test_written_tokenizer_files_load_in_transformers(tmp_path, cache_dir):
    transformers = pytest.importorskip("transformers")
    written = T.write_tokenizer_files(tmp_path / "ckpt")
    assert [p.name for p in written] == ["tokenizer.json", "tokenizer_config.json"]
    assert written[0].read_bytes() == T.v41_tokenizer_path().read_bytes()
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"))
    assert len(fast) == 129280
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (0, 1, 1)
    assert fast.convert_ids_to_tokens(128799) == "<｜System｜>"
    assert fast("Hello", add_special_tokens=False).input_ids == [19923]


def test_written_toy_tokenizer_round_trips(tmp_path):
    tok = toy_tokenizer()
    T.write_tokenizer_files(tmp_path, tok, pad_token="<｜▁pad▁｜>")
    back = T.load_tokenizer(tmp_path)
    assert back.get_vocab() == tok.get_vocab()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["pad_token"] == "<｜▁pad▁｜>"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        T.load_tokenizer(tmp_path / "nowhere")
