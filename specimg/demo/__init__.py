"""The embedded demo: offline data (``data``) and the bundle recipe (``recipe``); the shipped
weights live in ``bundle/`` and load with :func:`specimg.models.demo.load_demo`."""
