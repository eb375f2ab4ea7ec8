"""What the reader can fix: UserError, whose message the screen (or the API) shows as is."""


class UserError(Exception):
    """Something the reader can fix; the message is shown on screen as is."""
