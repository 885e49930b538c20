"""The private APIs of other libraries titan uses, where no public one exists: each is used in
one function only (named below), and this test fails first when a library moves or drops it,
instead of a behaviour quietly degrading."""

from __future__ import annotations

import inspect


def test_dcp_set_element_still_exists_for_the_safe_load_planner():
    """titan.ckpt.manager._SafeLoadPlanner.load_bytes puts a weights_only-loaded value back
    into the nested state dict with DCP's own `set_element` (no public equivalent)."""
    from torch.distributed.checkpoint._traverse import set_element

    state = {"a": {"b": [0, 1]}}
    set_element(state, ("a", "b", 1), 7)
    assert state == {"a": {"b": [0, 7]}}


def test_tyro_parse_error_hook_still_exists_for_one_line_errors():
    """titan.recipes.cli._one_line_parse_errors turns tyro's structured parse-error events into
    one-line messages through `tyro._errors.on_parse_error` (a fallback condenses tyro's boxed
    output, less precisely, if the hook goes away)."""
    from tyro._errors import on_parse_error

    assert callable(on_parse_error) and len(inspect.signature(on_parse_error).parameters) == 1
