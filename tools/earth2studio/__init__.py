"""This project's models in NVIDIA's Earth2Studio (docs/earth2studio.md).

  names.py       our channels' Earth2Studio names, the grids it can name
  package.py     a trained model as a package of files (export, read_package)
  source.py      a split of our data as an Earth2Studio data source
  prognostic.py  the Earth2Studio prognostic model of a package (needs Earth2Studio)
  compare.py     its forecasts against inference.py's saved ones

Only prognostic.py (and what imports it) needs Earth2Studio installed
(requirements-earth2studio.txt, `make venv-earth2studio`); the export does not.
"""
