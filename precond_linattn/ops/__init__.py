"""The public ops: ``delta_rule``, ``osgm_precondition``, ``atk_precondition`` and their steps."""
