"""Regular expressions of calendar formats, exact where a regex can be: real dates, RFC 3339 times."""

__all__ = ["DATE", "TIME", "OFFSET", "DATE_TIME"]

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999, as datetime.date
_LEAP = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
"""A calendar date ``YYYY-MM-DD`` that exists: days per month, Feb 29 only in leap years."""
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
"""A time of day ``HH:MM:SS``."""
OFFSET = "([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
DATE_TIME = f"{DATE}[Tt]{TIME}(\\.[0-9]+)?{OFFSET}"
"""An RFC 3339 date-time (JSON Schema's ``date-time``): a real date, a time, fractions of a
second if any, and an offset (``Z`` or ``+HH:MM``)."""
