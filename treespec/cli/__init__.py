"""The ``treespec`` command: ``generate | demo | plan | calibrate | train | export``.

    main   argument parsing, ``generate`` and ``demo``
    plan   ``treespec plan`` and ``treespec calibrate``
    viz    pictures of draft trees (``generate --draw``)
"""
