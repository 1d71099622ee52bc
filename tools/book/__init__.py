"""The step checker's modules; tools/steps.py is its command line (tools/README.md: "Where the code is").

    markers.py      the marker grammar, the parser, the readability rules
    registry.py     chapters/chapters.toml: chapters, fixes, rechecks, planted bugs
    stages.py       the book (registry + parsed sources, checked together) and building a stage
    running.py      pytest and commands in a stage; the stage's package and imports
    proofs.py       revert proofs (fixes, rechecks) and planted bugs
    chapters.py     snippets; the `snippets` and `outputs` commands
    transcripts.py  `<!-- output -->` blocks, run and compared
    figures.py      `<!-- fig: -->` and `<!-- out: -->` numbers
    diffs.py        `diff`, `tree` and `bugs`
    report.py       the console and check's Report
    check.py        `check`, the orchestration
"""
