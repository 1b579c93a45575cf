"""The one base class for errors a user can act on: bad input (config, data, reward code, model folder) or an engine
that failed. The CLI prints the first line of the message and exits 1; anything else is a bug and keeps its
traceback. Every message names what is wrong (the key, the file, the column, the row)."""


class UserError(Exception):
    """An error whose message is meant for the user, as one line."""


class NotFound(UserError, FileNotFoundError):
    """A run, stage, file or checkpoint the command needs does not exist."""


class AlreadyExists(UserError, FileExistsError):
    pass


class RewardLoadError(UserError):
    """A reward function, tool or environment of the user's (or a built-in's settings) that cannot be used: raised
    by the loader (tasks/rewards/loader.py) and by the built-ins' preflights, here so that neither imports the
    other."""


class TeacherError(UserError, ValueError):
    """A teacher or process reward model that cannot read the policy's token ids."""
