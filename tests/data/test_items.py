"""A user's dataset of any items (``hspmd.data.items``): layouts, the order drawn by (seed,
batch number), and the one-line refusals before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hspmd.data.errors import DataError
from hspmd.data.items import ItemLayout, open_dataset

DATA = Path(__file__).parents[1] / "models" / "data" / "image_items.py"


def _source(name: str) -> str:
    return f"{DATA}:{name}"


def test_layouts_name_the_fields_of_dicts_tuples_and_tensors() -> None:
    assert str(open_dataset(_source("images")).layout) == (
        "dict: image (1, 8, 8) float32, label () int64"
    )
    assert [f.name for f in open_dataset(_source("pairs")).layout.fields] == ["input0", "input1"]
    assert str(ItemLayout.of(torch.zeros(3))) == "tensor: input (3,) float32"


def test_a_batch_is_a_function_of_the_seed_and_its_number() -> None:
    data = open_dataset(_source("images"))
    first = data.batch(0, size=8, seed=0)
    assert [tuple(t.shape) for t in first] == [(8, 1, 8, 8), (8,)]
    again = data.batch(0, size=8, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = data.batch(0, size=8, seed=1)
    assert not torch.equal(first[1], other[1]) or not torch.equal(first[0], other[0])
    # an epoch (40 items, 5 batches of 8) visits every item once, in a permuted order
    epoch = torch.cat([data.batch(k, size=8, seed=0)[0] for k in range(5)])
    assert sorted(epoch.flatten(1).sum(1).tolist()) == sorted(
        data.items.images.flatten(1).sum(1).tolist()
    )
    assert not torch.equal(epoch, data.items.images)


def test_an_iterable_is_read_in_its_order_and_again_from_its_start() -> None:
    data = open_dataset(_source("stream"))
    assert data.length is None
    images = torch.cat([data.batch(k, size=8, seed=0)[0] for k in range(4)])  # 32 of 24
    assert torch.equal(images[24:], images[:8])
    assert torch.equal(data.batch(1, size=8, seed=5)[0], images[8:16])  # asked out of order
    with pytest.raises(DataError, match="an iterator \\(generator\\), which can be read once"):
        open_dataset(_source("once"))


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("few", "3 items, fewer than one step's 8"),
        ("ragged", "item 5's image is [1, 8, 7] float32, item 0's [1, 8, 8] float32"),
        ("broken", "the factory raised IndexError: list index out of range at "),
    ],
)
def test_bad_datasets_are_one_line(name: str, words: str) -> None:
    with pytest.raises(DataError) as error:
        open_dataset(_source(name)).check_step(8)
    text = str(error.value)
    assert words in text and "\n" not in text, text
    if name == "broken":
        assert text.endswith(f"{DATA}:{_line(DATA, '[1]  # raises')}")


def test_items_of_other_structures_and_bad_sources_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not nested structures"):
        ItemLayout.of({"image": torch.zeros(2), "meta": {"id": torch.zeros(1)}})
    with pytest.raises(DataError, match="has no callable 'nothing'"):
        open_dataset(_source("nothing"))
    with pytest.raises(DataError, match="no file"):
        open_dataset(f"{tmp_path / 'none.py'}:make")
    layout = ItemLayout.of({"image": torch.zeros(2), "label": 1})
    with pytest.raises(DataError, match="a tuple of \\['input0'\\], item 0 a dict"):
        layout.flatten((torch.zeros(2),), "item 3")


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)
