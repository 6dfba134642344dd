"""kvshelf's test suite: a package, so its helpers import as ``tests.support.*`` from the repo root."""
