"""YAML as te_mixtral reads it (config files, and values given on the command line): PyYAML's
safe loader, with the two things it lets through refused in one line each: a key given twice
in one mapping, and aliases that expand to more values than a config could hold.
"""

import yaml

from te_mixtral.errors import UserError

# Far above any real config (about a hundred values), far below what takes long to walk.
MAX_CONFIG_VALUES = 10_000


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, refusing a mapping that gives one key twice. The YAML spec
    forbids it, but PyYAML keeps the last: a second `train:` section appended to a config
    would silently drop every key of the first."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: the keys after it override its keys
                continue
            key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice (lines {seen[key]} and {line})", key_node.start_mark)
                seen[key] = line
            except TypeError:  # an unhashable key: the base class says so
                continue
        return super().construct_mapping(node, deep)


def load_yaml(text: str, where: str):
    """Parse YAML text, refusing a document whose aliases expand to more than
    MAX_CONFIG_VALUES values: an alias stands for its anchor's whole value, so a few lines of
    nested aliases (a "billion laughs") stand for billions of values, which a later walk of
    the config (or an error message that prints it) would expand. `where` names the text."""
    try:
        document = yaml.load(text, _UniqueKeyLoader)  # safe_load, refusing a key given twice
    except yaml.YAMLError as e:
        raise UserError(f"{where} is not valid YAML: {str(e).splitlines()[0]}") from None
    stack, count = [document], 0
    while stack:  # counts each value every time an alias repeats it
        value = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise UserError(f"{where} holds more than {MAX_CONFIG_VALUES} values once its YAML aliases are expanded; "
                            f"a config needs about a hundred")
        if isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return document
