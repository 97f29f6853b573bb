"""specimg's built-in methods, installed as the ``specimg_plugins`` package and registered
through the ``specimg`` entry-point group like any third-party plugin."""
