"""The same samples as Megatron-Core: every scenario is built by Megatron-Core's own
BlendedMegatronDatasetBuilder + GPTDataset (+ BlendedDataset), once per session in a subprocess
(megatron_core_samples.py), and by ours with the C++ helper and with the numpy twin. Indices,
lengths and the tokens of every sample, in order, must be identical.
"""
import json
import os

import numpy as np
import pytest

from megatron.core.datasets import BlendedDataset, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder, build_gpt_datasets
from megatron.core.datasets import helpers
from megatron.core.datasets.gpt_dataset_builder import parse_split, split_boundaries

REFERENCE_SCRIPT = os.path.join(os.path.dirname(__file__), "megatron_core_samples.py")
SPLITS = ("train", "valid", "test")

# name: (sequences, sequences per document (max), longest sequence, fraction of empty sequences, seed)
CORPORA = {
    "a": (1000, 1, 60, 0.15, 1),
    "b": (57, 1, 200, 0.0, 2),
    "c": (2017, 4, 30, 0.1, 3),
    "d": (333, 1, 90, 0.4, 4),
    "e": (12, 1, 120, 0.0, 5),
}

# Single-dataset sizes are in epochs of that split (converted to samples below), or ("final", E, d): E - 1
# epochs plus d more than 80% of an epoch's samples, the threshold for shuffling the final epoch apart.
# Blends ask for samples.
SCENARIOS = [
    dict(name="a-969-30-1", data_path=["a"], split="969,30,1", seq_length=16, seed=1234, epochs=(0.7, 2.75, 6.0)),
    dict(name="a-90-5-5", data_path=["a"], split="90,5,5", seq_length=16, seed=1234, epochs=(1.9, 1.2, 0.3)),
    dict(name="a-98-2-0", data_path=["a"], split="98,2,0", seq_length=33, seed=7, epochs=(5.3, 1.0, 0.5)),
    dict(name="a-99.5-0.5-0", data_path=["a"], split="99.5,0.5,0", seq_length=16, seed=5, epochs=(1.0, 1.0, 0)),
    dict(name="b-90-5-5", data_path=["b"], split="90,5,5", seq_length=8, seed=1234, epochs=(("final", 2, 0), 3.7, 1.0)),
    dict(name="c-969-30-1", data_path=["c"], split="969,30,1", seq_length=64, seed=1234, epochs=(3.1, ("final", 3, 0), 2.0)),
    dict(name="d-80-20", data_path=["d"], split="80,20", seq_length=16, seed=99, epochs=(("final", 2, -1), 0.9, 0)),
    dict(name="d-1-1-1", data_path=["d"], split="1,1,1", seq_length=16, seed=1234, epochs=(2.85, ("final", 3, -1), 4.0)),
    dict(name="e-100-0-0", data_path=["e"], split="100,0,0", seq_length=64, seed=1234, epochs=(7.5, 0, 0)),
    dict(name="blend-a.3-d.7", data_path=["0.3", "a", "0.7", "d"], split="90,5,5", seq_length=16, seed=1234,
         sizes=(2000, 200, 50)),
    dict(name="blend-a1-b2-c3", data_path=["1", "a", "2", "b", "3", "c"], split="98,2,0", seq_length=16, seed=1234,
         sizes=(3000, 100, 0)),
    dict(name="blend-a70-c30", data_path=["70", "a", "30", "c"], split="969,30,1", seq_length=32, seed=1234,
         sizes=(1500, 60, 20)),
    dict(name="blend-of-one-b", data_path=["1", "b"], split="90,5,5", seq_length=8, seed=1234, sizes=(500, 50, 20)),
    dict(name="blend-unweighted-a-d", data_path=["a", "d"], split="90,5,5", seq_length=16, seed=1234,
         sizes=(1000, 100, 10)),
    dict(name="per-split", per_split=(["0.6", "a", "0.4", "d"], ["b"], None), seq_length=16, seed=1234,
         sizes=(800, 50, 0)),
    dict(name="per-split-mixed", per_split=(["a", "d"], ["0.5", "b", "0.5", "e"], ["c"]), seq_length=16, seed=3,
         sizes=(900, 40, 30)),
]
BOUNDARY_SPLITS = ["90,5,5", "969,30,1", "98,2,0", "100,0,0", "1,1,1", "80,20", "99.5,0.5,0", "949,50,1", "2,1", "7,0,3",
                   "969, 30, 1", "98/2/0", "0,1,0", ".5,.25,.25"]
BOUNDARY_SIZES = list(range(1, 1201)) + [2017, 4999, 10007, 123457]


def write_corpus(prefix, sequences, per_document, longest, empty, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=sequences)
    lengths[rng.random(sequences) < empty] = 0
    lengths[-3:] = np.maximum(lengths[-3:], 1)  # every split Megatron-Core builds must hold tokens (it loops forever on none)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < sequences:
        count = min(int(rng.integers(1, per_document + 1)), sequences - written)
        for length in lengths[written:written + count]:
            builder.add_item(rng.integers(0, 60000, size=int(length)))
        builder.end_document()
        written += count
    builder.finalize(prefix + ".idx")


def sample_counts(scenario, prefixes):
    """Samples per split: given, or converted from the scenario's `epochs` of the split's single dataset."""
    if "sizes" in scenario:
        return list(scenario["sizes"])
    lengths = IndexedDataset(prefixes[scenario["data_path"][0]]).sequence_lengths
    seq_length, counts = scenario["seq_length"], []
    for bounds, epochs in zip(split_boundaries(parse_split(scenario["split"]), len(lengths)), scenario["epochs"]):
        tokens = int(lengths[bounds[0]:bounds[1]].sum()) if bounds else 0
        per_epoch = (tokens - 1) // seq_length
        if isinstance(epochs, tuple):
            _, full, delta = epochs
            counts.append(((full - 1) * tokens - 1) // seq_length + int(0.8 * per_epoch) + delta)
        else:
            counts.append(max(1, round(epochs * per_epoch)) if epochs else 0)
    return counts


def resolve(scenario, prefixes):
    """The scenario with corpus names replaced by prefixes and sizes in samples."""
    def paths(blend):
        return [prefixes.get(item, item) for item in blend] if blend else None

    resolved = {"name": scenario["name"], "seed": scenario["seed"], "seq_length": scenario["seq_length"],
                "sizes": sample_counts(scenario, prefixes)}
    if "per_split" in scenario:
        resolved["per_split"] = [paths(blend) for blend in scenario["per_split"]]
    else:
        resolved["data_path"], resolved["split"] = paths(scenario["data_path"]), scenario["split"]
    return resolved


@pytest.fixture(scope="session")
def reference(tmp_path_factory, megatron_core):
    """Every scenario built by Megatron-Core in one subprocess: (resolved scenarios, summary, arrays)."""
    directory = tmp_path_factory.mktemp("megatron_core_samples")
    prefixes = {name: str(directory / name) for name in CORPORA}
    for name, parameters in CORPORA.items():
        write_corpus(prefixes[name], *parameters)
    scenarios = {scenario["name"]: resolve(scenario, prefixes) for scenario in SCENARIOS}
    os.makedirs(directory / "cache")
    spec = {"scenarios": list(scenarios.values()), "cache": str(directory / "cache"), "output": str(directory / "reference"),
            "boundary_splits": BOUNDARY_SPLITS, "boundary_sizes": BOUNDARY_SIZES}
    (directory / "spec.json").write_text(json.dumps(spec))
    megatron_core(REFERENCE_SCRIPT, directory / "spec.json")
    summary = json.loads((directory / "reference.json").read_text())
    arrays = np.load(directory / "reference.npz")
    return scenarios, summary, {key: arrays[key] for key in arrays.files}


def test_split_boundaries_match_megatron_core(reference):
    _, summary, _ = reference
    for split, expected in summary["boundaries"].items():
        for size, theirs in zip(BOUNDARY_SIZES, expected):
            ours = [list(bounds) if bounds else None for bounds in split_boundaries(parse_split(split), size)]
            assert ours == theirs, f"--split {split} on {size} sequences"


def build_ours(scenario, cache_dir):
    per_split = scenario.get("per_split") or (None, None, None)
    config = GPTDatasetConfig(seq_length=scenario["seq_length"], seed=scenario["seed"], data_path=scenario.get("data_path"),
                              split=scenario.get("split") or "969,30,1", train_data_path=per_split[0],
                              valid_data_path=per_split[1], test_data_path=per_split[2], data_cache_path=str(cache_dir))
    return build_gpt_datasets(config, scenario["sizes"])


def assert_same_gpt(ours, arrays, key, summary):
    assert len(ours) == summary["len"], key
    for name in ("document_index", "sample_index", "shuffle_index"):
        theirs, mine = arrays[f"{key}/{name}"], np.asarray(getattr(ours, name))
        assert mine.dtype == theirs.dtype, f"{key}/{name}: {mine.dtype} vs {theirs.dtype}"
        np.testing.assert_array_equal(mine, theirs, err_msg=f"{key}/{name}")


def all_windows(dataset):
    windows = [np.concatenate([item["tokens"], item["labels"][-1:]]) for item in (dataset[i] for i in range(len(dataset)))]
    return np.stack(windows)


@pytest.mark.parametrize("implementation", ["cpp", "numpy"])
@pytest.mark.parametrize("name", [scenario["name"] for scenario in SCENARIOS])
def test_same_samples_as_megatron_core(reference, name, implementation, tmp_path, monkeypatch):
    if implementation == "cpp" and not helpers.cpp_available():
        pytest.skip("C++ helper not built: python setup.py build_ext --inplace")
    if implementation == "numpy":
        monkeypatch.setattr(helpers, "_cpp", None)
        monkeypatch.setattr(helpers, "_warned", True)
    scenarios, summary, arrays = reference
    scenario = scenarios[name]
    datasets = build_ours(scenario, tmp_path / "cache")
    for split, ours, theirs, size in zip(SPLITS, datasets, summary["scenarios"][name], scenario["sizes"]):
        key = f"{name}/{split}"
        if theirs["kind"] is None or size == 0:  # we build nothing for a split asked for no samples
            assert ours is None, key
            continue
        if theirs["kind"] == "blended":
            assert isinstance(ours, BlendedDataset) and len(ours) == theirs["len"], key
            assert [len(part) for part in ours.datasets] == [part["len"] for part in theirs["parts"]], key
            for j, (part, part_summary) in enumerate(zip(ours.datasets, theirs["parts"])):
                assert_same_gpt(part, arrays, f"{key}/part{j}", part_summary)
            for index in ("dataset_index", "dataset_sample_index"):
                np.testing.assert_array_equal(np.asarray(getattr(ours, index)), arrays[f"{key}/{index}"], err_msg=key)
        else:
            assert_same_gpt(ours, arrays, key, theirs)
        np.testing.assert_array_equal(all_windows(ours), arrays[f"{key}/tokens"], err_msg=f"{key}: tokens")


def gpt_keys(scenarios, summary):
    """(key, dataset prefix) of every GPTDataset Megatron-Core built, blend components included."""
    for name, splits in summary["scenarios"].items():
        scenario = scenarios[name]
        for index, (split, built) in enumerate(zip(SPLITS, splits)):
            blend = scenario["per_split"][index] if "per_split" in scenario else scenario["data_path"]
            prefixes = [item for item in blend or [] if os.path.exists(item + ".idx")]
            if built["kind"] == "gpt":
                yield f"{name}/{split}", prefixes[0]
            elif built["kind"] == "blended":
                yield from ((f"{name}/{split}/part{j}", prefix) for j, prefix in enumerate(prefixes))


def test_scenarios_cover_the_rules(reference):
    """One, two and more epochs; a separate and a joint final epoch; a stream that starts with an empty sequence."""
    scenarios, summary, arrays = reference
    epochs, separate, empty_first = set(), set(), 0
    for key, prefix in gpt_keys(scenarios, summary):
        document_index = arrays[f"{key}/document_index"]
        documents = len(np.unique(document_index))
        count = len(document_index) // documents
        epochs.add(min(count, 3))
        if count > 1:
            separate.add(bool(np.array_equal(np.sort(document_index[-documents:]), np.unique(document_index))))
        empty_first += int(IndexedDataset(prefix).sequence_lengths[document_index[0]] == 0)
    assert epochs == {1, 2, 3} and separate == {True, False} and empty_first > 0, (epochs, separate, empty_first)
