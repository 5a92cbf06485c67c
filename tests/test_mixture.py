"""formats/mixture.py's table of --out-type mixtures: every row well-formed (its rules name kinds
and conditions the code knows, its types are ones ggtrain writes); test_convert_interop checks
every row against llama.cpp's quantizer."""
import pytest

from ggtrain.core.models.config import ModelConfig, param_shapes
from ggtrain.formats.mixture import MIXTURES, WHEN, kind, mixture, tensor_types
from ggtrain.formats.model import FILE_TYPES
from ggtrain.formats.model_file import WRITE_TYPES
from ggtrain.errors import FormatError


@pytest.mark.parametrize("name", list(MIXTURES))
def test_rows_are_well_formed(name):
    m = MIXTURES[name]
    assert m.base in WRITE_TYPES
    for r in m.rules:
        assert r.kind in ("attn_v", "ffn_down", "attn_output") and r.when in WHEN and r.type in WRITE_TYPES, r
    assert len({int(x.file_type) for x in MIXTURES.values()}) == len(MIXTURES)


def test_single_type_file_types_come_from_the_table():
    assert {t.name.lower(): int(ft) for t, ft in FILE_TYPES.items()} == \
        {n: int(m.file_type) for n, m in MIXTURES.items() if n == m.base}


def test_unknown_name_lists_the_mixtures():
    with pytest.raises(FormatError, match="--out-type q4_k: not a type ggtrain writes .*q4_k_s, q4_k_m"):
        mixture("q4_k")
    assert mixture("Q4_K_M") is MIXTURES["q4_k_m"]


def test_70b_attn_v_gets_q5_k():
    """llama.cpp's LLM_TYPE_70B (80 llama layers with grouped KV heads) lifts attn_v from Q3_K/Q4_K
    to Q5_K (too big a model to check against llama.cpp here)."""
    for kv_heads, want in ((8, "q5_k"), (64, "q4_k")):
        cfg = ModelConfig(arch="llama", vocab=256, dim=512, layers=80, heads=64, kv_heads=kv_heads, ff=512, ctx=64)
        shapes = param_shapes(cfg)
        types = tensor_types(MIXTURES["q4_k_s"], {n: (s, "f32") for n, s in shapes.items()}, cfg)
        assert types["blk.40.attn_v.weight"] == want and types["blk.40.attn_q.weight"] == "q4_k"
        assert kind("blk.40.attn_v.weight") == "attn_v"
