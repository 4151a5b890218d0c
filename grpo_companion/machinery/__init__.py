"""The book machinery: papermill pipeline, chapter report, claims engine, Sphinx extension, CLI."""
