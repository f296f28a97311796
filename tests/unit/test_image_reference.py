"""``task.image`` follows Docker's reference grammar: every engine's own default image is
accepted (MindIE's tag has capitals), a repository with capitals is not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from heteroflow.core.engines.registry import ENGINES
from heteroflow.schemas.task_groups import TaskSpec


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_engines_default_image_is_a_valid_task_image(engine: str) -> None:
    image = ENGINES[engine].default_image
    assert TaskSpec(image=image, engine=engine).image == image


@pytest.mark.parametrize("image", ["Upper/repo:tag", "repo:tag with space", "repo:tag/x:Y Z"])
def test_malformed_references_are_refused(image: str) -> None:
    with pytest.raises(ValidationError):
        TaskSpec(image=image)
