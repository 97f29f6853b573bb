"""An example third-party specimg plugin package; its one method lives in topneighbour.py."""
