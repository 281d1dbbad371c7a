"""Third-party drafters: ``package.module:factory`` and the ``treespec.drafters`` entry-point
group resolve in ``load_drafter`` (so in every command's ``--drafter``), ``register_drafter``
takes ``replace=True``, and a protocol error names the missing member."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from treespec import SpeculativeGenerator
from treespec.drafters import load_drafter, plugin_drafters, register_drafter, registered_drafters
from treespec.drafters.base import _REGISTRY, drafter_factory, missing_members
from treespec.targets.loader import tiny_target

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

PLUGIN = '''
import torch

class UniformDrafter:
    """q uniform over the vocabulary: a valid, useless drafter."""
    needs_target_hidden = False
    target_layers = ()
    path_independent = True

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def begin(self, prompt_ids, features):
        pass

    def expand(self, tree, nodes):
        return torch.zeros(len(nodes), self.vocab_size)

    def commit(self, path, tokens, features):
        pass

def make(target, scale=1.0):
    return UniformDrafter(target.vocab_size)

class NoCommit(UniformDrafter):
    commit = None

def broken(target):
    return NoCommit(target.vocab_size)

not_callable = 3
'''


@pytest.fixture()
def plugin_pkg(tmp_path, monkeypatch):
    """A package ``mydrafters`` on sys.path, installed as a distribution whose entry points
    offer ``uniform`` (and ``broken``, whose module does not exist) in ``treespec.drafters``."""
    pkg = tmp_path / "mydrafters"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plug.py").write_text(textwrap.dedent(PLUGIN))
    dist = tmp_path / "mydrafters-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mydrafters\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[treespec.drafters]\nuniform = mydrafters.plug:make\n"
                                           "gone = mydrafters.missing:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("mydrafters")]:
        del sys.modules[name]


def test_module_factory_reference_loads_and_generates(plugin_pkg):
    target = tiny_target(vocab_size=32, seed=0)
    drafter = load_drafter("mydrafters.plug:make", target)
    assert type(drafter).__name__ == "UniformDrafter" and drafter.registry_name == "mydrafters.plug:make"
    assert load_drafter("mydrafters.plug:make[scale=2]", target).registry_name == "mydrafters.plug:make[scale=2]"
    out = SpeculativeGenerator(target, "mydrafters.plug:make").generate(torch.tensor([3, 4, 5]), max_new_tokens=6)
    assert out.token_ids.numel() > 0


def test_entry_point_loads_by_name(plugin_pkg):
    assert "uniform" in plugin_drafters() and "uniform" not in registered_drafters()
    drafter = load_drafter("uniform", tiny_target(vocab_size=32, seed=0))
    assert type(drafter).__name__ == "UniformDrafter"
    with pytest.raises(ImportError, match="'gone'.*mydrafters.missing:make.*failed to load"):
        drafter_factory("gone")


def test_unknown_name_lists_registered_plugins_and_the_forms(plugin_pkg):
    with pytest.raises(KeyError, match="unknown drafter 'nope'; registered: .*eagle3.*installed plugins: .*uniform"
                                       ".*'package.module:factory'.*treespec.drafters"):
        drafter_factory("nope")


@pytest.mark.parametrize("ref,error,match", [
    ("mydrafters.nothere:make", ValueError, "cannot import module 'mydrafters.nothere'.*PYTHONPATH"),
    ("mydrafters.plug:nothere", ValueError, "has no attribute 'nothere'; it defines .*make"),
    ("mydrafters.plug:not_callable", TypeError, "names int object, not a factory"),
    ("mydrafters.plug:", ValueError, "write a drafter of your own as 'package.module:factory'"),
])
def test_bad_references_say_what_is_wrong(plugin_pkg, ref, error, match):
    with pytest.raises(error, match=match):
        load_drafter(ref, tiny_target(vocab_size=32, seed=0))


def test_protocol_error_names_the_missing_member(plugin_pkg):
    target = tiny_target(vocab_size=32, seed=0)
    with pytest.raises(TypeError, match=r"drafter 'mydrafters.plug:broken' \(NoCommit\) is not a treespec Drafter: "
                                        r"it lacks commit\. "):
        load_drafter("mydrafters.plug:broken", target)

    class NoExpandNoVocab:
        needs_target_hidden, target_layers, path_independent = False, (), False

        def begin(self, prompt_ids, features): ...

        def commit(self, path, tokens, features): ...

    assert missing_members(NoExpandNoVocab()) == ["expand", "vocab_size"]
    with pytest.raises(TypeError, match="got NoExpandNoVocab; this one .* it lacks expand, vocab_size"):
        SpeculativeGenerator(target, NoExpandNoVocab())


def test_register_twice_needs_replace():
    name = "test-plugins-twice"
    try:
        register_drafter(name)(lambda target: None)
        with pytest.raises(ValueError, match=f"already registered; pass register_drafter\\('{name}', replace=True\\)"):
            register_drafter(name)(lambda target: None)

        def second(target):
            return None

        register_drafter(name, replace=True)(second)
        assert drafter_factory(name) is second
    finally:
        _REGISTRY.pop(name, None)
    with pytest.raises(ValueError, match="without any of"):
        register_drafter("a:b")


def test_cli_generate_takes_a_module_factory(plugin_pkg, capsys, monkeypatch):
    """``treespec generate --drafter package.module:factory`` on a tiny target with a word
    tokenizer (the CLI's own target loader is replaced by one that returns it)."""
    import treespec.cli.main as cli
    from treespec.targets.loader import Target

    from _engine_helpers import word_tokenizer

    words = [f"w{i}" for i in range(30)]
    base = tiny_target(vocab_size=32, seed=0)
    target = Target.from_hf(base.model, word_tokenizer(words), name="tiny-words")
    monkeypatch.setattr(cli, "_load_target", lambda args: target)
    code = cli.main(["generate", "--prompt", "w1 w2 w3", "--drafter", "mydrafters.plug:make", "--tree", "chain",
                     "--budget", "3", "--max-new-tokens", "4", "--stats"])
    assert code == 0
    assert "tau" in capsys.readouterr().out.lower()
