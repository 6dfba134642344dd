"""``kvshelf bench``: the evidence, measured on the user's own machine.

One module per report section (``ttft``, ``capacity``, ``quality``, ``phases``,
``routing``, ``peer``), each returning a JSON-able dict with a ``table`` (list of
rows); ``report`` turns them into ``REPORT.md`` with one PNG chart per table, and
``runner`` drives them in one process through kvshelf's public surfaces.
"""
