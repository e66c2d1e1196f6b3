"""Agentic RL, the episode side: tools (functions -> JSON schemas, Hermes ``<tool_call>`` parsing, guarded calls),
the sandboxed ``python`` tool, rendering conversations with tools and the tokens to insert after a model's turn,
environments (TRL's ``environment_factory``, message-level environments) behind one `EpisodeEnv` interface, an
executor for their blocking work, per-episode records and metrics, and built-in agent tasks (`agent.envs`).
The engine side (episodes paused with their KV kept) lives in `monorl.generate`."""

from monorl.agent.calls import ToolCall, format_tool_call, parse_tool_calls
from monorl.agent.env import EpisodeEnv, ToolEnv, TurnResult, row_of
from monorl.agent.environments import FactoryEnv, MessageEnvAdapter, environment_of
from monorl.agent.executor import AgentExecutor, call_with_timeout
from monorl.agent.metrics import EpisodeRecord, episode_metrics
from monorl.agent.render import ChatRenderer, template_renders_tools
from monorl.agent.schema import SchemaError, function_schema
from monorl.agent.task import AgentTask, safe_score_episode
from monorl.agent.tool_specs import load_tools
from monorl.agent.tools import Tool, ToolFailed, ToolResult, ToolSet

__all__ = ["AgentExecutor", "AgentTask", "ChatRenderer", "EpisodeEnv", "EpisodeRecord", "FactoryEnv",
           "MessageEnvAdapter", "SchemaError", "Tool", "ToolCall", "ToolEnv", "ToolFailed", "ToolResult", "ToolSet",
           "TurnResult",
           "call_with_timeout", "environment_of", "episode_metrics", "format_tool_call", "function_schema",
           "load_tools", "parse_tool_calls", "row_of", "safe_score_episode", "template_renders_tools"]
