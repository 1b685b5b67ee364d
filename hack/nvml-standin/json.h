/* A small JSON reader for the stand-in's config and faults files (no writer needed). */
#ifndef STANDIN_JSON_H
#define STANDIN_JSON_H

enum jtype { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };

typedef struct jval {
    enum jtype type;
    double num;
    long long inum; /* exact for integers up to 2^63 */
    int boolean;
    char *str;
    struct jval **items; /* array elements or object values */
    char **keys;         /* object keys */
    int n;
} jval;

/* Parse text; NULL on a syntax error, with a message in err (size errlen). */
jval *json_parse(const char *text, char *err, int errlen);
jval *json_read_file(const char *path, char *err, int errlen);
void json_free(jval *v);
const jval *json_get(const jval *obj, const char *key);
long long json_int(const jval *obj, const char *key, long long dflt);
const char *json_str(const jval *obj, const char *key, const char *dflt);
int json_bool(const jval *obj, const char *key, int dflt);

#endif
