/* A small recursive-descent JSON reader: enough for files the test rig writes itself. */
#include "json.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct parser {
    const char *s;
    char *err;
    int errlen;
    int depth;
};

static void ws(struct parser *p) {
    while (*p->s && isspace((unsigned char)*p->s)) p->s++;
}

static jval *fail(struct parser *p, const char *msg) {
    if (p->err && !p->err[0]) snprintf(p->err, (size_t)p->errlen, "%s near '%.20s'", msg, p->s);
    return NULL;
}

static jval *mk(enum jtype t) {
    jval *v = calloc(1, sizeof *v);
    if (v) v->type = t;
    return v;
}

static jval *value(struct parser *p);

static char *string(struct parser *p) {
    if (*p->s != '"') return NULL;
    p->s++;
    size_t cap = 16, len = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    while (*p->s && *p->s != '"') {
        char c = *p->s++;
        if (c == '\\') {
            char e = *p->s++;
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned code = 0;
                for (int i = 0; i < 4; i++) {
                    char h = *p->s++;
                    code <<= 4;
                    if (h >= '0' && h <= '9') code |= (unsigned)(h - '0');
                    else if (h >= 'a' && h <= 'f') code |= (unsigned)(h - 'a' + 10);
                    else if (h >= 'A' && h <= 'F') code |= (unsigned)(h - 'A' + 10);
                    else { free(out); return NULL; }
                }
                c = code < 0x80 ? (char)code : '?'; /* configs are ASCII */
                break;
            }
            case '"': case '\\': case '/': c = e; break;
            default: free(out); return NULL;
            }
        }
        if (len + 2 > cap) {
            cap *= 2;
            char *n = realloc(out, cap);
            if (!n) { free(out); return NULL; }
            out = n;
        }
        out[len++] = c;
    }
    if (*p->s != '"') { free(out); return NULL; }
    p->s++;
    out[len] = 0;
    return out;
}

static int push(jval *v, char *key, jval *item) {
    char **nk = NULL;
    jval **ni = realloc(v->items, sizeof(jval *) * (size_t)(v->n + 1));
    if (!ni) return -1;
    v->items = ni;
    if (v->type == J_OBJ) {
        nk = realloc(v->keys, sizeof(char *) * (size_t)(v->n + 1));
        if (!nk) return -1;
        v->keys = nk;
        v->keys[v->n] = key;
    }
    v->items[v->n++] = item;
    return 0;
}

static jval *container(struct parser *p, enum jtype t) {
    char close = t == J_ARR ? ']' : '}';
    jval *v = mk(t);
    if (!v) return fail(p, "out of memory");
    p->s++;
    ws(p);
    if (*p->s == close) { p->s++; return v; }
    for (;;) {
        char *key = NULL;
        ws(p);
        if (t == J_OBJ) {
            key = string(p);
            if (!key) { json_free(v); return fail(p, "expected a string key"); }
            ws(p);
            if (*p->s != ':') { free(key); json_free(v); return fail(p, "expected ':'"); }
            p->s++;
        }
        jval *item = value(p);
        if (!item || push(v, key, item) != 0) { free(key); json_free(item); json_free(v); return fail(p, "bad value"); }
        ws(p);
        if (*p->s == ',') { p->s++; continue; }
        if (*p->s == close) { p->s++; return v; }
        json_free(v);
        return fail(p, "expected ',' or a closing bracket");
    }
}

static jval *value(struct parser *p) {
    if (++p->depth > 64) return fail(p, "nested too deeply");
    ws(p);
    jval *v = NULL;
    char c = *p->s;
    if (c == '{') v = container(p, J_OBJ);
    else if (c == '[') v = container(p, J_ARR);
    else if (c == '"') {
        char *s = string(p);
        if (!s) return fail(p, "bad string");
        v = mk(J_STR);
        if (v) v->str = s; else free(s);
    } else if (!strncmp(p->s, "true", 4) || !strncmp(p->s, "false", 5)) {
        v = mk(J_BOOL);
        if (v) v->boolean = c == 't';
        p->s += c == 't' ? 4 : 5;
    } else if (!strncmp(p->s, "null", 4)) {
        v = mk(J_NULL);
        p->s += 4;
    } else if (c == '-' || isdigit((unsigned char)c)) {
        char *end1, *end2;
        double d = strtod(p->s, &end1);
        long long i = strtoll(p->s, &end2, 10);
        v = mk(J_NUM);
        if (v) { v->num = d; v->inum = end2 == end1 ? i : (long long)d; }
        p->s = end1;
    } else {
        return fail(p, "unexpected character");
    }
    p->depth--;
    return v;
}

jval *json_parse(const char *text, char *err, int errlen) {
    struct parser p = {text, err, errlen, 0};
    if (err && errlen) err[0] = 0;
    jval *v = value(&p);
    if (!v) return NULL;
    ws(&p);
    if (*p.s) { json_free(v); return fail(&p, "trailing characters"); }
    return v;
}

jval *json_read_file(const char *path, char *err, int errlen) {
    FILE *f = fopen(path, "r");
    if (!f) { snprintf(err, (size_t)errlen, "cannot open %s", path); return NULL; }
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (len + 1 >= cap) { cap *= 2; char *n = realloc(buf, cap); if (!n) { free(buf); buf = NULL; } else buf = n; }
    }
    fclose(f);
    if (!buf) { snprintf(err, (size_t)errlen, "out of memory reading %s", path); return NULL; }
    buf[len] = 0;
    jval *v = json_parse(buf, err, errlen);
    free(buf);
    return v;
}

void json_free(jval *v) {
    if (!v) return;
    for (int i = 0; i < v->n; i++) {
        json_free(v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    free(v);
}

const jval *json_get(const jval *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (int i = 0; i < obj->n; i++)
        if (!strcmp(obj->keys[i], key)) return obj->items[i];
    return NULL;
}

long long json_int(const jval *obj, const char *key, long long dflt) {
    const jval *v = json_get(obj, key);
    return v && v->type == J_NUM ? v->inum : dflt;
}

const char *json_str(const jval *obj, const char *key, const char *dflt) {
    const jval *v = json_get(obj, key);
    return v && v->type == J_STR ? v->str : dflt;
}

int json_bool(const jval *obj, const char *key, int dflt) {
    const jval *v = json_get(obj, key);
    return v && v->type == J_BOOL ? v->boolean : dflt;
}
