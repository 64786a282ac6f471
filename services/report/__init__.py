"""``refinery report``: one self-contained HTML file of figures over the lake.

Public API: :func:`services.report.cli.build_report` (lake path, window, job → HTML text) and
the ``report`` command registered by :func:`services.report.cli.add_parser`.
"""
