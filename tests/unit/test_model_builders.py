"""The local model builders' command line (no build: that needs torch and runs in make test)."""

from __future__ import annotations

import pytest

from vllm_affinity.testing.build_model import main
from vllm_affinity.testing.hybrid_model import HYBRID_DIRS, HYBRID_SHAPES, build_hybrid
from vllm_affinity.testing.tiny_model import ARCHS


def test_every_hybrid_shape_is_an_arch_with_a_folder_of_its_own() -> None:
    assert ("llama", *HYBRID_SHAPES) == ARCHS
    assert len({path for path in HYBRID_DIRS.values()}) == len(HYBRID_SHAPES)
    for shape in HYBRID_SHAPES.values():
        if "layer_types" not in shape:
            continue  # one kind of layer, not a full-attention one (deepseek-v3: MLA)
        kinds = set(shape["layer_types"])
        # hybrid: two kinds of layer; or every layer one sparse kind (linear-only)
        assert (len(kinds) == 2 and "full_attention" in kinds) or kinds == {"linear_attention"}


def test_bad_arguments_are_refused_before_building(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--arch", "gpt-oss", "--size", "heavy"])
    assert "--size applies to --arch llama only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--arch", "mixtral"])
    with pytest.raises(ValueError, match="unknown hybrid arch"):
        build_hybrid("llama")


def test_the_models_are_built_in_the_repository_cache() -> None:
    """The builders live in ``vllm_affinity/testing/``; their models in the checkout's ``.cache``
    (what the Makefile's targets and every test read)."""
    from pathlib import Path

    from vllm_affinity.testing.tiny_model import DEFAULT_DIR

    assert Path(__file__).resolve().parents[2] / ".cache" / "tiny-llama" == DEFAULT_DIR
