"""`fa_verify report`: run a sweep into the results store and render it.

    from fa_verify.report import write_report
    write_report(ResultsStore("reports/results.jsonl").read(), "reports")

Pieces, in the order data flows: `runner` (sweep → records, with `budget` and `progress`;
`deviations` marks runs that fail only by a backend's declared conventions, `failure` keeps a
failing run's worst element, `ulp` the ULP errors of outputs that are not tiny),
`data` (records → plain dataclasses, grouped by `buckets`, figures combined by `aggregate`,
whose "× rounded" ranks the backends), `render` (index.html and summary.md from the templates,
figures from `plots`), `summary` (summary.json).
"""

from __future__ import annotations

from pathlib import Path

from fa_verify.report.data import ReportData, build
from fa_verify.report.run_info import RunInfo
from fa_verify.results import utc_now

OUTPUTS = ("index.html", "summary.json", "summary.md")


def write_report(records, out_dir, *, run: RunInfo | None = None,
                 generated: str | None = None, published: dict | None = None) -> ReportData:
    """Render `records` into out_dir/index.html, summary.json and summary.md, and the worst
    cases' reproducers into out_dir/repro/.

    run: the sweep's RunInfo (skips, environment); without it the environment is this machine's.
    generated: the timestamp shown (default: now, UTC).
    published: the reproduced published results (`published.measure`'s JSON), also saved as
    out_dir/published.json; None: the page says how to get them.
    """
    from fa_verify.report import published as reproductions
    from fa_verify.report.environment import collect
    from fa_verify.report.render import render_html, render_markdown
    from fa_verify.report.summary import summary_json

    generated = generated or utc_now()
    environment = None if run is not None and run.environment else collect()
    out = Path(out_dir)
    data = build(records, run=run, environment=environment, generated=generated, repro_dir=out / "repro")
    out.mkdir(parents=True, exist_ok=True)
    if published:
        reproductions.save(published, out)
    html = render_html(data, reproductions.view(published))
    for name, text in (("index.html", html), ("summary.json", summary_json(data)),
                       ("summary.md", render_markdown(data))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out / name)  # a reader never sees half a page
    return data


__all__ = ["OUTPUTS", "ReportData", "RunInfo", "build", "write_report"]
