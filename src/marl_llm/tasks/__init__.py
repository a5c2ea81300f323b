"""Built-in tasks. Importing this package registers each of them in TASKS."""

from marl_llm.tasks.base import TASKS, JointReward, Problem, Task, Turn, build_task, register_task
from marl_llm.tasks import humaneval  # noqa: F401  (registers "humaneval")

__all__ = ["TASKS", "JointReward", "Problem", "Task", "Turn", "build_task", "register_task"]
