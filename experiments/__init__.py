"""The project's studies, one folder each, outside the installed package: each folder holds its
plan, report code, tests, results and figures, and a README with its question, command and
answer. `mod study experiments/<study>` runs one (the folder's ``__init__.py`` defines
``STUDY``); experiments/README.md lists them. They depend on the library, never the reverse."""
