"""The docs cannot drift from the code: their examples run against it, their commands exist.

Markers in the Markdown say what is checked: ``<!-- docs-test: validate Class -->`` before a
JSON block (every JSON block of the docs written here needs one) validates it with that class
of ``service.bundle``; ``<!-- docs-test: excerpt path -->`` before a code block checks that its
lines appear, in order, in that file; ``<!-- docs-test: skip ... -->`` leaves a block alone.
Every other Python block of ``docs/extractor-plugins.md`` is run.
"""

from __future__ import annotations

import base64
import io
import re
import sys
import time
import tomllib
import types
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
from PIL import Image
from pydantic import BaseModel

import service.bundle
import service.extractors.base as extractor_base
from service.bundle import ExtractorSpec, ItemSpec, Manifest
from service.cache import extractor_tag, feature_key
from service.execution import execute
from service.extractors.base import (
    ENTRY_POINT_GROUP,
    Extractor,
    ExtractorVersionMismatch,
    available_extractors,
    create_extractor,
)
from service.items import content_key, make_decoder
from service.registry import CalibrationSettings, load_bundle

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUNDLE_FORMAT = DOCS / "bundle-format.md"
PLUGINS = DOCS / "extractor-plugins.md"
OWN_DOCS = (DOCS / "architecture.md", BUNDLE_FORMAT, PLUGINS)

_FENCE = re.compile(
    r"(?:<!--\s*docs-test:\s*(?P<marker>[^>]*?)\s*-->[ \t]*\n)?"
    r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    marker: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [
        Block(path, text.count("\n", 0, m.start("body")), m["lang"], m["body"], m["marker"] or "")
        for m in _FENCE.finditer(text)
    ]


def code_texts(path: Path) -> list[str]:
    """The fenced blocks and the inline code spans of a Markdown file."""
    text = path.read_text()
    fenced = [m["body"] for m in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)
    return fenced + re.findall(r"`([^`\n]+)`", prose)


def validator(block: Block) -> type[BaseModel]:
    kind, _, name = block.marker.partition(" ")
    assert kind == "validate", f"{block.where}: a JSON block needs <!-- docs-test: validate X -->"
    cls = getattr(service.bundle, name.strip(), None)
    assert isinstance(cls, type) and issubclass(cls, BaseModel), f"{block.where}: no {name!r}"
    return cls


# -- the bundle format ---------------------------------------------------------------------


def test_json_examples_validate() -> None:
    validated: list[str] = []
    for path in OWN_DOCS:
        for block in blocks(path):
            if block.lang == "json":
                cls = validator(block)
                cls.model_validate_json(block.body)
                validated.append(cls.__name__)
    assert "Manifest" in validated


def _onnx_classifier(input_dims: int, classes: int) -> bytes:
    """A softmax-regression model following the bundle's ONNX conventions."""
    from onnx import TensorProto, helper, numpy_helper

    weights = np.random.default_rng(0).normal(size=(input_dims, classes)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["features", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        ],
        "docs_example",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, input_dims])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, classes])],
        [
            numpy_helper.from_array(weights, "W"),
            numpy_helper.from_array(np.zeros(classes, dtype=np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _png_b64(width: int, height: int) -> str:
    ramp = np.add.outer(np.arange(height), np.arange(width)) * 255 // (width + height)
    buffer = io.BytesIO()
    Image.fromarray(ramp.astype(np.uint8), mode="L").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_example_manifests_load_and_answer(tmp_path: Path) -> None:
    manifests = [
        Manifest.model_validate_json(b.body)
        for b in blocks(BUNDLE_FORMAT)
        if b.lang == "json" and validator(b) is Manifest
    ]
    assert manifests
    for manifest in manifests:
        folder = tmp_path / manifest.name
        folder.mkdir()
        (folder / "manifest.json").write_text(manifest.model_dump_json())
        for model in manifest.models:
            if model.file is not None:
                onnx = _onnx_classifier(model.input_dims, len(manifest.classes))
                (folder / model.file).write_bytes(onnx)
        bundle = load_bundle(folder, 1 << 22, CalibrationSettings(enabled=False))
        assert manifest.item.kind == "image"
        item = bundle.decoder.decode({"png_base64": _png_b64(64, 48)})
        run = execute(bundle, item, 100.0, {}, time.perf_counter())
        assert run.answer in {m.id for m in manifest.models}
        assert run.probabilities.shape == (len(manifest.classes),)


# -- commands named in the docs ------------------------------------------------------------


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", makefile, re.MULTILINE))


def _cli_commands() -> set[str]:
    from training.cli import app

    # typer vendors its own click: read the group's commands without naming its class
    commands = getattr(typer.main.get_command(app), "commands", None)
    assert isinstance(commands, dict) and commands
    return set(commands)


def test_make_targets_and_cli_commands_exist() -> None:
    targets, commands = _make_targets(), _cli_commands()
    named_targets: dict[str, str] = {}
    named_commands: dict[str, str] = {}
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for code in code_texts(path):
            for line in code.splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line)
                for match in re.finditer(r"(?:^|[\s;&|(])make\s+(.*)", line):
                    for token in match[1].split():
                        if "=" in token:
                            continue
                        if not re.fullmatch(r"[A-Za-z][\w.-]*", token):
                            break
                        named_targets.setdefault(token, path.name)
                for match in re.finditer(r"budgetserve-train\s+([^\s`]+)", line):
                    for name in match[1].split("|"):
                        if re.fullmatch(r"[a-z][a-z0-9_-]*", name):
                            named_commands.setdefault(name, path.name)
    assert {"serve", "test"} <= set(named_targets)  # the parsing found the README's
    assert "build" in named_commands
    unknown_targets = {t: f for t, f in named_targets.items() if t not in targets}
    unknown_commands = {c: f for c, f in named_commands.items() if c not in commands}
    assert not unknown_targets, f"make targets not in the Makefile: {unknown_targets}"
    assert not unknown_commands, f"budgetserve-train has no such commands: {unknown_commands}"


# -- the extractor plugin example ----------------------------------------------------------


@dataclass(frozen=True)
class DocPlugin:
    entry_point: str
    cls: Any
    module: str


def _plugin_blocks() -> tuple[str, str, Block]:
    """The entry point (name, value) of the example pyproject and the module it names."""
    plugin_blocks = blocks(PLUGINS)
    tomls = [b for b in plugin_blocks if b.lang == "toml"]
    assert len(tomls) == 1, "expected one pyproject.toml example"
    declared = tomllib.loads(tomls[0].body)["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert len(declared) == 1, "expected one entry point in the example"
    [(name, value)] = declared.items()
    module_path = value.partition(":")[0].replace(".", "/") + ".py"
    modules = [b for b in plugin_blocks if b.body.startswith(f"# {module_path}\n")]
    assert len(modules) == 1, f"expected one Python block starting with '# {module_path}'"
    return name, value, modules[0]


@pytest.fixture
def doc_plugin(monkeypatch: pytest.MonkeyPatch) -> DocPlugin:
    """The example plugin, importable and registered as if its package were installed."""
    name, value, block = _plugin_blocks()
    module_name, _, class_name = value.partition(":")
    package = module_name.rpartition(".")[0]
    if package:
        monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    module = types.ModuleType(module_name)
    monkeypatch.setitem(sys.modules, module_name, module)
    exec(compile(block.body, block.where, "exec"), module.__dict__)

    def with_plugin(*, group: str) -> list[EntryPoint]:
        found = list(entry_points(group=group))
        if group == ENTRY_POINT_GROUP:
            found.append(EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP))
        return found

    monkeypatch.setattr(extractor_base, "entry_points", with_plugin)
    return DocPlugin(name, getattr(module, class_name), module_name)


def test_example_plugin_satisfies_the_protocol(doc_plugin: DocPlugin) -> None:
    name, cls = doc_plugin.entry_point, doc_plugin.cls
    assert available_extractors()[name] is cls
    assert cls.name == name, "the builder records the class's name: keep it the entry point's"
    extractor = create_extractor(name, cls.version, {})
    assert isinstance(extractor, Extractor)
    with pytest.raises(ExtractorVersionMismatch):
        create_extractor(name, cls.version + "-other")

    decoder = make_decoder(ItemSpec.model_validate({"kind": cls.item_kind}), 1 << 22)
    item = decoder.decode({"png_base64": _png_b64(64, 48)})
    warm_up = np.zeros((32, 32), dtype=np.float32)  # what service.registry warms up with
    for data in (item.data, warm_up):
        vector = extractor.extract(data)
        assert isinstance(vector, np.ndarray) and vector.dtype == np.float32
        assert vector.shape == (extractor.dims,) and np.all(np.isfinite(vector))
    with pytest.raises(ValueError):
        extractor.extract(np.zeros(16, dtype=np.float32))
    assert create_extractor(name, cls.version, {"grid": 8}).dims == 64


def test_plugin_doc_snippets_run(doc_plugin: DocPlugin) -> None:
    module_block = _plugin_blocks()[2]
    ran = 0
    for block in blocks(PLUGINS):
        if block.lang != "python" or block == module_block or block.marker.startswith("skip"):
            continue
        if block.marker.startswith("excerpt "):
            source = (ROOT / block.marker.removeprefix("excerpt ").strip()).read_text()
            position = 0
            for line in filter(None, (s.strip() for s in block.body.splitlines())):
                found = source.find(line, position)
                assert found >= 0, f"{block.where}: {line!r} is not in the source (in order)"
                position = found + len(line)
            continue
        namespace: dict[str, Any] = {"__name__": "docs_snippet"}
        exec(compile(block.body, block.where, "exec"), namespace)
        ran += 1
        if "spec" in namespace:
            assert isinstance(namespace["spec"], ExtractorSpec)
    assert ran >= 1


def test_documented_cache_keys_and_extractor_specs() -> None:
    text = PLUGINS.read_text()
    png = "<png>"  # the BLAKE2b-256 of a PNG's bytes, as the table writes it
    scan = content_key("png1", b"", "scan-42").split(":id:")[1]
    vitals = make_decoder(ItemSpec(kind="tabular", columns=["pressure", "bmi", "skin"]), 1)
    patient = vitals.decode(
        {"id": "patient-17", "values": {"pressure": 72, "bmi": 31.2, "skin": 20}}
    ).key
    examples: list[tuple[str, str, dict[str, Any]]] = [
        (f"png1:{png}", "edge_density", {}),
        (f"png1:{png}:id:{scan}", "edge_density", {"grid": 8}),
        (patient, "vitals", {"columns": ["pressure", "bmi", "skin"]}),
    ]
    for item_key, name, params in examples:
        key = feature_key(item_key, extractor_tag(name, "1", params))
        assert f"`{key}`" in text, f"docs/extractor-plugins.md should show the key {key}"
    specs = [
        ExtractorSpec.model_validate_json(b.body)
        for b in blocks(PLUGINS)
        if b.lang == "json" and validator(b) is ExtractorSpec
    ]
    assert specs
    for spec in specs:
        extractor = create_extractor(spec.entry_point, spec.version, spec.params)
        assert extractor.dims == spec.dims
