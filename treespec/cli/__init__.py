"""The ``treespec`` command: ``generate | demo | bench | plan | calibrate | train | export | serve``.

    main   argument parsing, ``generate`` and ``demo``
    plan   ``treespec plan`` and ``treespec calibrate``
    bench  ``treespec bench``: drafters x trees x temperatures against plain decoding (and its Python API)
    trees  tree builders by name and size (``make_builder``), for every command
    viz    pictures of draft trees (``generate --draw``)
"""
