"""Retired agent settings (D5 retired HETEROFLOW_AGENT_WAKE_READY_TIMEOUT_S): an operator
who still sets one is told at the agent's start what replaced it, not silently ignored."""

from __future__ import annotations

from heteroflow.settings import RETIRED_AGENT_SETTINGS, AgentSettings, retired_agent_settings


def test_a_retired_setting_still_set_is_named_with_what_replaced_it() -> None:
    (line,) = retired_agent_settings({"HETEROFLOW_AGENT_WAKE_READY_TIMEOUT_S": "600"})
    assert line.startswith("HETEROFLOW_AGENT_WAKE_READY_TIMEOUT_S is set but no longer read")
    assert "HETEROFLOW_AGENT_LOAD_STALL_S" in line and "HETEROFLOW_AGENT_LOAD_CEILING_S" in line
    # the environment's case does not matter to the settings, nor here
    assert retired_agent_settings({"heteroflow_agent_wake_ready_timeout_s": "600"})
    assert retired_agent_settings({"HETEROFLOW_AGENT_LOAD_STALL_S": "300"}) == []


def test_what_replaced_them_exists_and_they_are_truly_gone() -> None:
    fields = AgentSettings.model_fields
    assert not set(RETIRED_AGENT_SETTINGS) & set(fields)  # else it is not retired
    assert {"load_stall_s", "load_ceiling_s"} <= set(fields)
