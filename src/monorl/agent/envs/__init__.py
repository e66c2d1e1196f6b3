"""Built-in agent tasks: `gsm8k_python` (GSM8K with the sandboxed python tool), `guess_number` (a multi-turn game
with higher / lower feedback), `tiny_tools` (a tool-only task for the tiny char-level preset), and
`agent_dataset` (your data, tools, environment_factory and reward functions, TRL style)."""

from monorl.agent.dataset_env import AgentDatasetTask
from monorl.agent.envs.gsm8k_python import Gsm8kPythonTask
from monorl.agent.envs.guess_number import GuessNumberEnv, GuessNumberTask
from monorl.agent.envs.tiny_tools import TinyToolsTask

AGENT_TASKS = {"gsm8k_python": Gsm8kPythonTask, "guess_number": GuessNumberTask, "tiny_tools": TinyToolsTask,
               "agent_dataset": AgentDatasetTask}

__all__ = ["AGENT_TASKS", "AgentDatasetTask", "GuessNumberEnv", "GuessNumberTask", "Gsm8kPythonTask", "TinyToolsTask"]
