"""Family detection: a LlamaGen file or a Hugging Face folder, each family's loader, and
`specimg models`."""

import json
import re

import attrs
import pytest
import torch

from specimg.errors import SpecimgError
from specimg.models import families, load_target
from specimg.models.llamagen import LlamaGenTarget, build_target
from specimg.models.loading import TINY_GPT


def hf_folder(path, model_type):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def test_a_llamagen_file_loads_through_the_family_loader(tmp_path):
    target = build_target("GPT-B", seed=2, **TINY_GPT)
    torch.save({"model": target.state_dict()}, tmp_path / "gpt.pt")
    loaded = load_target(tmp_path / "gpt.pt", preset="GPT-B", **TINY_GPT)
    assert isinstance(loaded, LlamaGenTarget) and families.detect_family(tmp_path / "gpt.pt").name == "llamagen"
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in target.state_dict().items())


@pytest.mark.parametrize("model_type, name", [("janus", "janus"), ("chameleon", "lumina")])
def test_hugging_face_folders_by_model_type(tmp_path, monkeypatch, model_type, name):
    folder = hf_folder(tmp_path / "model", model_type)
    assert families.detect_family(folder).name == name
    absent = attrs.evolve(families.FAMILIES[name], module="specimg.models.no_such_family")
    monkeypatch.setitem(families.FAMILIES, name, absent)
    with pytest.raises(SpecimgError, match=re.escape(f"{absent.title} targets are not supported yet")):
        load_target(folder)
    assert "[not supported yet: needs specimg.models.no_such_family]" in "\n".join(families.catalogue())


def test_what_is_no_family_is_a_user_error(tmp_path):
    with pytest.raises(SpecimgError, match="model_type 'bert' is no supported family"):
        families.detect_family(hf_folder(tmp_path / "bert", "bert"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecimgError, match="no Hugging Face model folder"):
        families.detect_family(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(SpecimgError, match="not a checkpoint file"):
        families.detect_family(tmp_path / "notes.txt")
    with pytest.raises(SpecimgError, match="checkpoint not found"):
        families.detect_family(tmp_path / "absent.pt")


def test_models_command_lists_families_and_presets(capsys):
    from specimg.cli import main

    main(["models"])
    out = capsys.readouterr().out
    for word in ("llamagen", "GPT-XL", "janus", "lumina", "VQ-16", "VQ-8", "--text-encoder"):
        assert word in out


def test_models_command_lists_the_built_in_models_and_their_drafter_file(capsys):
    from specimg.cli import main

    main(["models"])
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.strip()}
    assert set(families.BUILT_IN_MODELS) <= listed
    assert "--drafter FILE replaces the model's drafter" in out
